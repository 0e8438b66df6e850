// A job's page (/jobs/<id>): its header, a chart per metric, the timeline, the log's tail, the spec, the
// summary and the compression report. Polled every 2 s until the job has ended; then one last refresh
// (its summary, its last metrics) and the page stays as it is.

import { api, jobEnded, onLeave, poll } from "/static/app.js";
import { chartedMetrics, lineChart, reportChart, xyChart } from "/static/charts.js";
import { badge, detailText, el, setText } from "/static/dom.js";
import * as f from "/static/format.js";
import { profileSection } from "/static/profile.js";


// a figure the job's own files gave (range-checked by the server), told apart from what the server measured
const REPORTED = "as the job reports it (range-checked), not measured by the server";

export async function render(root, { id }) {
  const first = await api(`/api/v1/jobs/${id}`);
  if (first.status === 404 || first.status === 422) return noJob(root, id); // 422: an id past int32
  if (!first.ok) {
    root.replaceChildren(el("p", { class: "error", text: detailText(first) }));
    return;
  }

  const head = el("dl", { class: "job-head" });
  const chartsBox = el("div", { class: "charts" });
  const noCharts = el("p", { class: "muted", text: "no metrics yet" });
  const timeline = el("ul", { id: "timeline" });
  const log = el("pre", { id: "log", tabindex: "0" });
  const summary = el("div", { id: "summary" });
  const spec = el("pre", { id: "spec" });
  const title = el("h1", { id: "job-title" });
  const reportSlot = el("div"); // #report goes here once the job has one
  const profileSlot = el("div"); // #profile goes here once the run has one
  const lrSlot = el("div"); // #lr-find goes here once the run's range test (train.lr auto) wrote its curve
  root.replaceChildren(
    el("p", { class: "crumbs" }, el("a", { href: "/", text: "Jobs" }), ` / job ${id}`),
    title,
    head,
    el("section", {}, el("h2", { text: "Metrics" }), noCharts, chartsBox),
    lrSlot,
    profileSlot,
    el(
      "div",
      { class: "two-col" },
      el("section", {}, el("h2", { text: "Timeline" }), timeline),
      el("section", {}, el("h2", { text: "Log" }), log),
    ),
    el("section", {}, el("h2", { text: "Summary" }), summary),
    reportSlot,
    el("section", {}, el("h2", { text: "Spec" }), spec),
  );

  const charts = new Map(); // metric → {div, chart}
  let records = null; // the series' record count at the last draw: unchanged, nothing to redraw
  let lastSeq = -1;
  let logOffset = -1;
  let lastState = null;
  let report = null; // {chart} while drawn
  let lrChart = null; // the range test's chart while drawn
  let script = false; // a script job (kind: script): every figure it logs is charted
  let files = {}; // {server path: the user's name} of its uploads: the spec and summary show the name
  let charged = null; // the ledger's cost: the summary's cost row shows this one number, as the header does
  onLeave(() => {
    for (const c of charts.values()) c.chart.destroy();
    report?.chart.destroy();
    lrChart?.destroy();
  });

  drawHead(first.data);
  await loadSpec(); // before the first charts: a script job's own figures are charted too
  poll(refresh);

  async function refresh() {
    const answer = await api(`/api/v1/jobs/${id}`);
    if (answer.status === 404) {
      noJob(root, id); // deleted, or no longer this key's to see
      return false;
    }
    if (!answer.ok) throw new Error(detailText(answer));
    const job = answer.data;
    drawHead(job);
    // read after the job: when it says ended, these hold everything its run wrote (the last refresh)
    const reads = [series(), events(), logs()];
    if (job.state !== lastState) reads.push(loadSummary(), loadReport(), loadProfile(), loadLrFind()); // written when a run stops
    lastState = job.state;
    await Promise.all(reads);
    return !jobEnded(job.state);
  }

  function drawHead(job) {
    charged = job.cost_usd;
    const costCell = summary.querySelector("tr[data-key=cost_usd] td");
    if (costCell && charged != null) setText(costCell, f.dollars(charged));
    setText(title, job.name);
    document.title = `${job.name} · gpuforge`;
    const owner = job.owner && typeof job.owner === "object" ? job.owner.name : job.owner;
    const items = [
      ["state", badge(job.state)],
      ["owner", owner ?? "—"],
      ["devices", f.devices(job)],
      ["isolation", job.isolation],
      ["step", f.steps(job.step, job.total_steps)],
      ["loss", f.sig4(job.loss), REPORTED],
      ["cost", f.dollars(job.cost_usd), "charged by the server's ledger"],
      ["energy", job.energy_kwh == null ? null : `${job.energy_kwh.toPrecision(3)} kWh`, job.energy_source],
      ["CO2e", job.co2e_g == null ? null : `${job.co2e_g.toPrecision(3)} g`, "its kWh × the grid's gCO2e/kWh"],
      ["ETA", jobEnded(job.state) ? "—" : f.duration(job.eta_s), REPORTED],
      ["restarts", job.restarts == null ? null : `${job.restarts} of ${job.max_restarts}`],
      ["reason", job.reason],
    ];
    head.replaceChildren(
      ...items
        .filter(([, v]) => v !== null && v !== undefined && v !== "")
        .map(([k, v, source]) =>
          el("div", {}, el("dt", { text: k, ...(source ? { title: source } : {}) }), el("dd", { "data-field": k.toLowerCase() }, v)),
        ),
    );
  }

  // --- charts: created as metrics appear (eval_* at the first eval), updated in place ---
  async function series() {
    const answer = await api(`/api/v1/jobs/${id}/series?max_points=1000`);
    if (!answer.ok) return;
    const metrics = answer.data.metrics || {};
    const names = chartedMetrics(Object.keys(metrics), null, script);
    const same = typeof records === "number" && answer.data.records === records && names.length === charts.size;
    if (same) return;
    records = answer.data.records;
    noCharts.hidden = names.length > 0;
    for (const name of names) {
      let c = charts.get(name);
      if (!c) {
        const div = el("div", { class: "chart", "data-metric": name, "data-points": 0 });
        chartsBox.append(div); // in the page first: the chart takes the div's width
        c = { div, chart: lineChart(div, { title: name, metric: name, labels: [name], sync: `job-${id}` }) };
        charts.set(name, c);
      }
      const { step, value } = metrics[name];
      c.chart.setData([step, value]);
      c.div.dataset.points = String(step.length);
    }
    // keep the charts in order when a new one came in between (eval_accuracy after eval_loss, ...)
    const order = names.map((n) => charts.get(n).div);
    if (order.some((div, i) => chartsBox.children[i] !== div)) chartsBox.append(...order);
  }

  // --- the timeline: only the events after the last one shown ---
  async function events() {
    const answer = await api(`/api/v1/jobs/${id}/events?after=${lastSeq}`);
    if (!answer.ok || answer.data.length === 0) return;
    const follow = nearBottom(timeline);
    for (const e of answer.data) {
      lastSeq = Math.max(lastSeq, e.seq);
      timeline.append(
        el(
          "li",
          { "data-event": e.kind, title: JSON.stringify(e.data ?? {}) },
          el("time", { text: f.when(e.ts) }),
          el("span", { class: "kind", text: e.kind }),
          el("span", { class: "what", text: eventText(e.data ?? {}) }),
        ),
      );
      if (e.kind === "compressed") loadReport(); // the report lands with this event
      if (e.kind === "profiled") loadProfile(); // so does a profile asked for while it runs
      if (e.kind === "lr_found") loadLrFind(); // the range test's curve, before step 1
    }
    if (follow) timeline.scrollTop = timeline.scrollHeight;
  }

  // --- the log's tail, following unless the reader scrolled up ---
  async function logs() {
    const answer = await api(`/api/v1/jobs/${id}/logs?tail=200`);
    if (!answer.ok || answer.data.offset === logOffset) return;
    const follow = logOffset === -1 || nearBottom(log);
    logOffset = answer.data.offset;
    log.textContent = answer.data.lines.join("\n");
    if (follow) log.scrollTop = log.scrollHeight;
  }

  async function loadSpec() {
    const answer = await api(`/api/v1/jobs/${id}/spec`);
    files = (answer.ok && answer.data.files) || {};
    spec.textContent = answer.ok ? inUsersNames(answer.data.yaml, files) : detailText(answer);
    script = answer.ok && answer.data.spec?.kind === "script";
  }

  async function loadSummary() {
    const answer = await api(`/api/v1/jobs/${id}/summary`);
    if (answer.status === 404) {
      summary.replaceChildren(el("p", { class: "muted", text: "no summary yet" }));
    } else if (answer.ok) {
      const rows = flatten(answer.data).map(([k, raw]) => {
        const v = typeof raw === "string" ? inUsersNames(raw, files) : raw;
        // the run's own cost differs from the ledger's in the last digit: one figure, the ledger's
        const shown = k === "cost_usd" && charged != null ? f.dollars(charged) : f.byKey(k, v);
        const exact = v === null ? "" : typeof v === "object" ? JSON.stringify(v) : String(v);
        const title = k === "cost_usd" && charged != null ? "charged by the server's ledger" : exact;
        return el("tr", { "data-key": k }, el("th", { scope: "row", text: k }), el("td", { text: shown, title }));
      });
      summary.replaceChildren(el("table", { class: "kv" }, el("tbody", {}, rows)));
    }
  }

  // --- the profile: a stacked bar of the mean step, advice, operators, the trace; none without one ---
  async function loadProfile() {
    profileSlot.replaceChildren(...[await profileSection(id)].filter(Boolean));
  }

  // --- train.lr auto: the range test's loss against the rate (log scale), the pick and why ---
  async function loadLrFind() {
    const answer = await api(`/api/v1/jobs/${id}/lr_find`);
    if (!answer.ok || !Array.isArray(answer.data?.points)) return; // none (yet): what is drawn stays
    const { points, lr, reason, seconds } = answer.data;
    lrChart?.destroy();
    const div = el("div", { class: "chart", "data-metric": "lr_find", "data-points": String(points.length) });
    const said = `${reason}` + (seconds != null ? ` · the test took ${f.duration(seconds)}` : "");
    lrSlot.replaceChildren(
      el(
        "section",
        { id: "lr-find" },
        el("h2", { text: "Learning rate (range test)" }),
        el("p", { class: "muted", title: REPORTED, "data-lr": String(lr), text: said }),
        el("div", { class: "charts" }, div),
      ),
    );
    const rate = (v) => f.sig4(10 ** v);
    lrChart = xyChart(div, { title: "loss against learning rate", xLabel: "lr", yLabel: "loss", xFormat: rate, labels: ["loss"] });
    lrChart.setData([points.map((p) => Math.log10(p[0])), points.map((p) => p[1])]);
  }

  // --- the compression report: a table and size-against-metric points; no section without one ---
  async function loadReport() {
    const answer = await api(`/api/v1/jobs/${id}/report`);
    report?.chart.destroy();
    report = null;
    if (!answer.ok || !Array.isArray(answer.data?.variants)) {
      reportSlot.replaceChildren();
      return;
    }
    const variants = answer.data.variants;
    const metricName = variants.find((v) => v.metric?.name)?.metric.name ?? "metric";
    const rows = variants.map((v) =>
      el(
        "tr",
        { "data-variant": v.name, class: v.pareto ? "pareto" : null },
        el("td", { text: v.name }),
        el("td", { class: "num", text: f.num(v.params) }),
        el("td", { class: "num", text: f.bytes(v.disk_bytes) }),
        el("td", { class: "num", text: f.bytes(v.memory_bytes) }),
        el("td", { class: "num", text: f.sig4(v.latency_ms_b1) }),
        el("td", { class: "num", text: f.sig4(v.latency_ms_b32) }),
        el("td", { class: "num", text: f.sig4(v.metric?.value) }),
        el("td", { text: v.pareto ? "yes" : "" }),
      ),
    );
    const head = ["variant", "params", "disk", "memory", "ms (batch 1)", "ms (batch 32)", metricName, "Pareto"];
    const numeric = (i) => i >= 1 && i <= 6;
    const table = el(
      "table",
      { class: "report" },
      el("thead", {}, el("tr", {}, head.map((h, i) => el("th", { text: h, class: numeric(i) ? "num" : null })))),
      el("tbody", {}, rows),
    );
    const div = el("div", { class: "chart", "data-metric": "report", "data-points": 0 });
    reportSlot.replaceChildren(
      el(
        "section",
        { id: "report" },
        el("h2", { text: "Compression report" }),
        el("div", { class: "table-wrap" }, table),
        el("div", { class: "charts" }, div),
      ),
    );
    report = reportChart(div, variants);
    div.dataset.points = String(report.points);
  }
}

// What an event says, in a few words: its step, attempt, path, variants, reason.
function eventText(d) {
  const parts = [];
  if (d.step != null) parts.push(d.total_steps != null ? `step ${d.step}/${d.total_steps}` : `step ${d.step}`);
  if (d.attempt != null) parts.push(`attempt ${d.attempt}`);
  if (d.resumed_from != null) parts.push(`resumed from ${d.resumed_from}`);
  if (d.devices) parts.push(String(d.devices));
  if (d.device) parts.push(String(d.device));
  if (d.path) parts.push(String(d.path));
  if (Array.isArray(d.variants)) parts.push(`variants: ${d.variants.join(", ")}`);
  if (d.cost_usd != null) parts.push(f.dollars(d.cost_usd));
  if (d.reason) parts.push(String(d.reason));
  const text = parts.join(" · ");
  return text.length > 300 ? `${text.slice(0, 300)}…` : text;
}

// {a: {b: 1}, c: [1, 2]} → [["a.b", 1], ["c", [1, 2]]]: a summary's nested dicts as one key a row.
function flatten(obj, prefix = "") {
  return Object.entries(obj).flatMap(([k, v]) =>
    v && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length
      ? flatten(v, `${prefix}${k}.`)
      : [[`${prefix}${k}`, v]],
  );
}

// `text` with each upload's server path (<home>/uploads/<sha256>.py) in the name the user's client gave it.
function inUsersNames(text, files) {
  const longestFirst = Object.entries(files).sort(([a], [b]) => b.length - a.length);
  return longestFirst.reduce((t, [server, name]) => t.split(server).join(name), String(text));
}

// The page of a job that is not there (or not this key's to see): which one, and the way back.
function noJob(root, id) {
  root.replaceChildren(
    el("p", { class: "crumbs" }, el("a", { href: "/", text: "Jobs" }), ` / job ${id}`),
    el("p", { id: "not-found" }, `no job ${id} (or not one this key may see) · `, el("a", { href: "/", text: "back to the jobs" })),
  );
  document.title = `no job ${id} · gpuforge`;
}

// Whether a scrolled box shows its end (then new lines keep it there).
function nearBottom(box) {
  return box.scrollTop + box.clientHeight >= box.scrollHeight - 8;
}
