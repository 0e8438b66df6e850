// Costs (/costs): spend per key per day over a period (the last 30 days unless the URL says otherwise),
// from the server's cost ledger (charged minute by minute as jobs and replicas run), as a table with
// totals and a bar a day; a cell's title gives its jobs and device time. The table lists the days that spent
// (the chart shows the whole period); time nobody priced reads "no price set", with the command that sets
// one, never $0.

import { api, onLeave, SignedOut } from "/static/app.js";
import { costChart } from "/static/charts.js";
import { detailText, el, fill } from "/static/dom.js";
import * as f from "/static/format.js";

const DAY_MS = 86400 * 1000;
const isoDay = (d) => d.toISOString().slice(0, 10); // the server counts days in UTC
const DAY = /^\d{4}-\d{2}-\d{2}$/;

export async function render(root, { params }) {
  const today = new Date();
  const since = el("input", { type: "date", name: "since", required: true });
  const until = el("input", { type: "date", name: "until", required: true });
  since.value = DAY.test(params.get("since") ?? "") ? params.get("since") : isoDay(new Date(today - 29 * DAY_MS));
  until.value = DAY.test(params.get("until") ?? "") ? params.get("until") : isoDay(today);
  const form = el(
    "form",
    { id: "costs-period", class: "toolbar" },
    el("label", {}, "From ", since),
    el("label", {}, "to ", until),
    el("button", { type: "submit", text: "Show" }),
  );
  const error = el("p", { class: "error", role: "alert" });
  const out = el("div");
  root.replaceChildren(el("h1", { text: "Costs" }), form, error, out);

  let chart = null;
  onLeave(() => chart?.destroy());

  async function load() {
    const q = new URLSearchParams({ since: since.value, until: until.value });
    history.replaceState(null, "", `/costs?${q}`); // a reload or a shared link shows the same period
    const answer = await api(`/api/v1/costs?${q}`);
    chart?.destroy();
    chart = null;
    if (!answer.ok) {
      error.textContent = detailText(answer);
      out.replaceChildren();
      return;
    }
    error.textContent = "";
    const { keys = [], days = [], rows = [], total_usd: total, total_device_hours: hours, total_kwh: kwh = 0, total_co2e_g: co2e = 0, unpriced = [], set_price: setPrice = [] } = answer.data;
    const cell = new Map(rows.map((r) => [`${r.day}\n${r.key}`, r]));
    const dayTotal = (day) => keys.reduce((n, k) => n + (cell.get(`${day}\n${k}`)?.usd ?? 0), 0);
    const keyTotal = (key) => rows.filter((r) => r.key === key).reduce((n, r) => n + (r.usd ?? 0), 0);
    const ran = (r) => [r.jobs && `${r.jobs} job${r.jobs === 1 ? "" : "s"}`, r.deployments && `${r.deployments} deployment${r.deployments === 1 ? "" : "s"}`, `${f.duration(r.device_hours * 3600)} of device time`, r.kwh && energyText(r.kwh, r.co2e_g)].filter(Boolean).join(", ");
    const keyEnergy = (key) => rows.filter((r) => r.key === key).reduce((n, r) => n + (r.kwh ?? 0), 0);
    const usdText = (usd, unpricedCount) => {
      if (!unpricedCount) return usd ? f.dollars(usd) : "—";
      return usd ? `${f.dollars(usd)} + ${unpricedCount} unpriced` : "no price set";
    };
    const money = (r) => el("td", { class: r?.unpriced ? "num no-price" : "num", text: r ? usdText(r.usd, r.unpriced) : "—", title: r ? ran(r) : null });
    const dayUnpriced = (day) => keys.reduce((n, k) => n + (cell.get(`${day}\n${k}`)?.unpriced ?? 0), 0);
    const keyUnpriced = (key) => rows.filter((r) => r.key === key).reduce((n, r) => n + (r.unpriced ?? 0), 0);
    const spentDays = days.filter((day) => keys.some((k) => cell.has(`${day}\n${k}`)));

    const table = el(
      "table",
      { id: "costs" },
      el("thead", {}, el("tr", {}, el("th", { text: "day" }), keys.map((k) => el("th", { class: "num", text: k })), el("th", { class: "num", text: "total" }))),
      el(
        "tbody",
        {},
        // newest first: today's spend is what a reader looks for (the chart keeps time left to right)
        [...spentDays].reverse().map((day) =>
          el(
            "tr",
            { "data-day": day },
            el("th", { scope: "row", text: day }),
            keys.map((k) => money(cell.get(`${day}\n${k}`))),
            el("td", { class: "num total", text: usdText(dayTotal(day), dayUnpriced(day)) }),
          ),
        ),
      ),
      el(
        "tfoot",
        {},
        el("tr", { class: "total" }, el("th", { scope: "row", text: "total" }), keys.map((k) => el("td", { class: "num", text: usdText(keyTotal(k), keyUnpriced(k)) })), el("td", { class: "num", "data-field": "total_usd", text: usdText(total ?? keys.reduce((n, k) => n + keyTotal(k), 0), unpriced.length) })),
        el("tr", { class: "energy" }, el("th", { scope: "row", text: "kWh" }), keys.map((k) => el("td", { class: "num", text: keyEnergy(k) ? keyEnergy(k).toPrecision(3) : "—" })), el("td", { class: "num", "data-field": "total_kwh", text: kwh ? kwh.toPrecision(3) : "—" })),
      ),
    );
    const div = el("div", { class: "chart wide", "data-metric": "costs", "data-points": days.length });
    fill(out,
      keys.length ? el("p", { class: "muted", "data-field": "total_device_hours", text: `${f.duration((hours ?? 0) * 3600)} of device time in all${kwh ? `, ${energyText(kwh, co2e)}` : ""}` }) : el("p", { class: "muted", text: "nothing spent in this period" }),
      unpriced.length ? notPriced(unpriced, setPrice) : null,
      days.length ? el("div", { class: "charts" }, div) : null,
      spentDays.length ? el("div", { class: "table-wrap" }, table) : null,
    );
    if (days.length) chart = costChart(div, days, days.map(dayTotal));
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    load().catch((err) => {
      if (!(err instanceof SignedOut)) error.textContent = `cannot reach the server (${err.message})`;
    });
  });
  await load();
}

// What ran with no price set: its time is counted, its dollars are not known (not $0); and how to price it.
function notPriced(unpriced, commands) {
  const what = unpriced.map((u) => `${u.kind} ${u.id}${u.name ? ` ${u.name}` : ""} (${f.duration(u.device_hours * 3600)} on ${u.device_type})`);
  return el(
    "div",
    { class: "no-price", id: "no-price", role: "note" },
    el("p", { text: `No price set for ${what.join(", ")}: not costed, so the dollars here leave them out.` }),
    el("p", {}, "Set one with ", ...commands.flatMap((c, i) => [i ? " or " : "", el("code", { text: c })])),
  );
}

// energy as the server measured or estimated it (each job's page says how), CO2e where a grid intensity is set
function energyText(kwh, co2e) {
  return `${kwh.toPrecision(3)} kWh${co2e ? ` (${co2e.toPrecision(3)} g CO2e)` : ""}`;
}
