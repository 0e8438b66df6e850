// Compare (/compare?ids=3,5,8): the runs' curves overlaid on shared axes (x: step), the spec keys that
// differ, and the final figures side by side; refreshed every 2 s while a run is still live.

import { api, jobEnded, onLeave, poll } from "/static/app.js";
import { PALETTE, align, chartedMetrics, lineChart } from "/static/charts.js";
import { badge, detailText, el, notFound } from "/static/dom.js";
import * as f from "/static/format.js";

// throughput and quality; memory and step cost say little across runs of different shapes
const COMPARED = (name) => name === "loss" || name.startsWith("eval_") || name === "samples_per_s" || name === "mfu";


export async function render(root, { params }) {
  const ids = params.get("ids") ?? "";
  const answer = await api(`/api/v1/compare?${new URLSearchParams({ ids })}`);
  if (answer.status === 404) return notFound(root);
  if (!answer.ok) {
    root.replaceChildren(el("h1", { text: "Compare" }), el("p", { id: "compare-error", class: "error", role: "alert", text: detailText(answer) }));
    return;
  }
  const jobs = answer.data.jobs ?? [];
  const label = (job) => `#${job.id} ${job.name}`;
  const color = new Map(jobs.map((job, i) => [job.id, PALETTE[i % PALETTE.length]]));

  const runs = el("ul", { class: "runs" });
  const chartsBox = el("div", { class: "charts" });
  const noCharts = el("p", { class: "muted", text: "no metrics yet" });
  const tables = el("div");
  root.replaceChildren(
    el("p", { class: "crumbs" }, el("a", { href: "/", text: "Jobs" }), " / compare"),
    el("h1", { text: `Compare ${jobs.length} runs` }),
    runs,
    el("section", {}, el("h2", { text: "Metrics" }), noCharts, chartsBox),
    tables,
  );

  const charts = new Map(); // metric → {div, chart, runs: "id,id"}: rebuilt only when its runs change
  onLeave(() => charts.forEach((c) => c.chart.destroy()));

  // Draw what /compare said and the runs' series; again every 2 s while any of them is still live.
  async function draw(data) {
    runs.replaceChildren(
      ...data.jobs.map((job) =>
        el("li", { "data-job-id": job.id }, swatch(color.get(job.id)), el("a", { href: `/jobs/${job.id}`, text: label(job) }), " ", badge(job.state), job.owner ? ` ${job.owner}` : ""),
      ),
    );
    tables.replaceChildren(
      el("section", {}, el("h2", { text: "Spec: the keys that differ" }), el("div", { class: "table-wrap" }, specDiff(data.jobs, data.spec_diff ?? [], label))),
      el("section", {}, el("h2", { text: "Final figures" }), el("div", { class: "table-wrap" }, finalsTable(data.jobs, data.finals ?? [], label))),
    );
    // each run's series side by side (a run the key cannot read any more simply draws nothing)
    const series = await Promise.all(
      data.jobs.map(async (job) => {
        const s = await api(`/api/v1/jobs/${job.id}/series?max_points=1000`);
        return s.ok ? s.data.metrics || {} : {};
      }),
    );
    const names = chartedMetrics([...new Set(series.flatMap((m) => Object.keys(m)))], COMPARED);
    noCharts.hidden = names.length > 0;
    for (const name of names) {
      const drawn = data.jobs.map((job, i) => ({ job, table: series[i][name] })).filter((r) => r.table?.step?.length);
      const key = drawn.map((r) => r.job.id).join(",");
      let c = charts.get(name);
      if (c && c.runs !== key) {
        c.chart.destroy(); // a run's first point of this metric: a series more
        c.div.replaceChildren();
      }
      if (!c || c.runs !== key) {
        const div = c?.div ?? el("div", { class: "chart", "data-metric": name });
        if (!c) chartsBox.append(div);
        const chart = lineChart(div, {
          title: name,
          metric: name,
          labels: drawn.map((r) => label(r.job)),
          colors: drawn.map((r) => color.get(r.job.id)),
          sync: "compare",
        });
        charts.set(name, (c = { div, chart, runs: key }));
      }
      c.chart.setData(align(drawn.map((r) => r.table)));
      c.div.dataset.runs = String(drawn.length);
      c.div.dataset.points = String(drawn.reduce((n, r) => n + r.table.step.length, 0));
    }
    const order = names.map((n) => charts.get(n).div);
    if (order.some((div, i) => chartsBox.children[i] !== div)) chartsBox.append(...order);
    return data.jobs.some((job) => !jobEnded(job.state));
  }

  let first = answer.data;
  poll(async () => {
    let data = first;
    first = null;
    if (!data) {
      const again = await api(`/api/v1/compare?${new URLSearchParams({ ids })}`);
      if (!again.ok) return false; // gone since (404): what is drawn stays
      data = again.data;
    }
    return draw(data);
  });
}

function swatch(color) {
  const s = el("span", { class: "swatch" });
  s.style.background = color; // CSSOM, not a style attribute: the CSP allows it
  return s;
}

// One row a spec key that differs, one column a job.
function specDiff(jobs, diff, label) {
  if (!diff.length) return el("table", { id: "spec-diff" }, el("tbody", {}, el("tr", {}, el("td", { class: "muted", text: "the specs do not differ" }))));
  const show = (v) => (v === undefined || v === null ? "—" : typeof v === "string" ? v : JSON.stringify(v));
  return el(
    "table",
    { id: "spec-diff" },
    el("thead", {}, el("tr", {}, el("th", { text: "key" }), jobs.map((j) => el("th", { text: label(j) })))),
    el(
      "tbody",
      {},
      diff.map((d) => el("tr", { "data-key": d.key }, el("th", { scope: "row", text: d.key }), (d.values || []).map((v) => el("td", { text: show(v) })))),
    ),
  );
}

// One row a job: its final loss, each eval figure any of them has, throughput, MFU, cost, wall time.
function finalsTable(jobs, finals, label) {
  const byId = new Map(jobs.map((j) => [j.id, j]));
  const evalKeys = [...new Set(finals.flatMap((r) => Object.keys(r.eval || {})))].sort();
  const head = ["job", "final loss", ...evalKeys.map((k) => `eval ${k}`), "samples/s", "MFU", "cost", "wall"];
  return el(
    "table",
    { id: "finals" },
    el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { text: h, class: i > 0 ? "num" : null })))),
    el(
      "tbody",
      {},
      finals.map((r) =>
        el(
          "tr",
          { "data-job-id": r.id },
          el("th", { scope: "row" }, el("a", { href: `/jobs/${r.id}`, text: byId.has(r.id) ? label(byId.get(r.id)) : `#${r.id}` })),
          el("td", { class: "num", "data-field": "final_loss", text: f.sig4(r.final_loss) }),
          evalKeys.map((k) => el("td", { class: "num", "data-field": `eval_${k}`, text: f.sig4(r.eval?.[k]) })),
          el("td", { class: "num", "data-field": "samples_per_s", text: f.num(r.samples_per_s) }),
          el("td", { class: "num", "data-field": "mfu", text: f.pct(r.mfu) }),
          el("td", { class: "num", "data-field": "cost_usd", text: f.dollars(r.cost_usd) }),
          el("td", { class: "num", "data-field": "wall_s", text: f.duration(r.wall_s) }),
        ),
      ),
    ),
  );
}
