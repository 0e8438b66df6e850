// Devices (/devices): each device, who holds it, how busy it was in the last hour and in all (the server's
// ledger: jobs and replicas alike), what it costs an hour (or "no price set" and the command), its memory.
// Polled.

import { api, poll } from "/static/app.js";
import { detailText, el } from "/static/dom.js";
import * as f from "/static/format.js";

const HOUR = 3600;

export async function render(root) {
  const table = el(
    "table",
    { id: "devices" },
    el("thead", {}, el("tr", {}, ["id", "kind", "name", "held by", "busy, last hour", "busy in all", "price an hour", "memory used / total"].map((h) => el("th", { text: h })))),
    el("tbody"),
  );
  const error = el("p", { class: "error", role: "alert" });
  root.replaceChildren(el("h1", { text: "Devices" }), error, el("div", { class: "table-wrap" }, table));
  const rows = new Map(); // device id → tr, redrawn in place

  poll(async () => {
    const answer = await api("/api/v1/devices");
    if (!answer.ok) {
      error.textContent = detailText(answer);
      return;
    }
    error.textContent = "";
    const tbody = table.tBodies[0];
    const seen = new Set();
    answer.data.forEach((d, i) => {
      seen.add(String(d.id));
      let tr = rows.get(String(d.id));
      if (!tr) {
        tr = el("tr", { "data-device-id": d.id });
        rows.set(String(d.id), tr);
      }
      if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] ?? null); // the API's order
      tr.replaceChildren(
        el("td", { "data-field": "id", text: d.id }),
        el("td", { "data-field": "kind", text: d.kind ?? "—" }),
        el("td", { "data-field": "name", text: d.name ?? "—" }),
        el("td", { "data-field": "holder" }, holder(d)),
        el("td", { "data-field": "busy" }, busy(d.busy_s_last_hour)),
        el("td", { "data-field": "busy_in_all", class: "num", text: f.duration(d.busy_seconds ?? 0) }),
        el("td", { "data-field": "price" }, price(d)),
        el("td", { "data-field": "memory", class: "num", text: memory(d) }),
      );
    });
    for (const [id, tr] of rows) {
      if (!seen.has(id)) {
        tr.remove();
        rows.delete(id);
      }
    }
  });
}

// Who holds it: a job (a link; another key's job is not named to this key), a deployment's replica, or no one.
function holder(d) {
  if (d.held_by === "job") {
    if (!d.job) return el("span", { class: "muted", text: "another key's job" });
    const owner = d.job.owner && typeof d.job.owner === "object" ? d.job.owner.name : d.job.owner;
    return el("span", {}, el("a", { href: `/jobs/${d.job.id}`, text: `job ${d.job.id} ${d.job.name ?? ""}`.trim() }), owner ? ` (${owner})` : "");
  }
  if (d.held_by === "replica") {
    if (!d.deployment) return el("span", { class: "muted", text: "another key's deployment" });
    return el("span", {}, el("a", { href: "/deployments", text: d.deployment.name }), ` replica ${d.deployment.replica}`);
  }
  return el("span", { class: "muted", text: "free" });
}

// Busy seconds of the last hour: a bar of the hour, and the minutes.
function busy(seconds) {
  if (seconds == null) return "—";
  const share = Math.min(1, Math.max(0, seconds / HOUR));
  const fill = el("span", { class: "fill" });
  fill.style.width = `${(share * 100).toFixed(1)}%`; // CSSOM, not a style attribute: the CSP allows it
  return el(
    "span",
    { class: "busy", title: `${Math.round(seconds)} s of the last hour` },
    el("span", { class: "bar", role: "img", "aria-label": `${Math.round(share * 100)}% busy` }, fill),
    ` ${Math.round(share * 100)}% · ${(seconds / 60).toFixed(seconds < 600 ? 1 : 0)} min`,
  );
}

// What it costs an hour, and from where; unpriced: said so, with the command that prices it, never $0.
function price(d) {
  if (d.usd_per_hour == null) {
    return el("span", { class: "no-price", title: d.set_price ?? "" }, "no price set", d.set_price ? el("code", { class: "muted", text: ` ${d.set_price}` }) : "");
  }
  return el("span", { title: d.price_source ?? "" }, f.dollars(d.usd_per_hour));
}

function memory(d) {
  if (d.memory_bytes == null && d.memory_used_bytes == null) return "—";
  return `${f.bytes(d.memory_used_bytes)} / ${f.bytes(d.memory_bytes)}`;
}
