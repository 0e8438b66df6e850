// Hyperparameter searches: the list (/searches) and one search (/searches/N): its state, spend and what is
// left of its budget, its trials (each a job), their curves overlaid (pruned ones faded), the best objective
// against money spent, the parameters against the objective (parallel coordinates), the importances, and
// "deploy best". Polled while the search runs. Objectives are the trials' own evaluations; costs the ledger's.

import { api, onLeave, poll } from "/static/app.js";
import { align, lineChart, PALETTE, xyChart } from "/static/charts.js";
import { badge, detailText, el, fill, table } from "/static/dom.js";
import * as f from "/static/format.js";

const FADED = "rgba(156, 163, 175, 0.55)"; // a pruned or stopped trial's curve
const ENDED = ["finished", "budget_spent", "stopped", "failed"];
const SVG = "http://www.w3.org/2000/svg";

export async function render(root, { id }) {
  if (id) return one(root, Number(id));
  return list(root);
}

async function list(root) {
  const t = table("searches", ["id", "name", "owner", "state", "why"]);
  const error = el("p", { class: "error", role: "alert" });
  root.replaceChildren(el("h1", { text: "Searches" }), error, el("div", { class: "table-wrap" }, t));
  poll(async () => {
    const answer = await api("/api/v1/searches");
    if (!answer.ok) {
      error.textContent = detailText(answer);
      return;
    }
    error.textContent = "";
    fill(
      t.tBodies[0],
      answer.data.map((s) =>
        el(
          "tr",
          { "data-search-id": s.id },
          el("td", {}, el("a", { href: `/searches/${s.id}`, text: String(s.id) })),
          el("td", { text: s.name }),
          el("td", { text: s.owner ?? "—" }),
          el("td", {}, badge(s.state)),
          el("td", { text: s.reason ?? "" }),
        ),
      ),
    );
  });
}

const shownParams = (params) =>
  Object.entries(params)
    .map(([k, v]) => `${k}=${typeof v === "number" ? f.sig4(v) : v}`)
    .join(", ");

async function one(root, id) {
  const head = el("p", { id: "search-summary" });
  const error = el("p", { class: "error", role: "alert" });
  const trials = table("trials", ["trial", "job", "state", "parameters", "value", "steps", "cost", "why"]);
  const curvesDiv = el("div", { class: "chart", "data-metric": "curves", "data-points": 0 });
  const spendDiv = el("div", { class: "chart", "data-metric": "best-vs-spend", "data-points": 0 });
  const parallel = el("div", { class: "chart parallel", "data-metric": "parallel", "data-points": 0 });
  const importances = table("importances", ["parameter", "importance"]);
  const best = el("p", { id: "best" });
  const deployName = el("input", { name: "name", required: true, pattern: "[A-Za-z0-9][A-Za-z0-9._-]*", placeholder: "deployment name" });
  const deployed = el("p", { id: "deployed", role: "status" });
  const deployForm = el("form", { id: "deploy-best", class: "toolbar" }, deployName, el("button", { type: "submit", text: "Deploy best" }));
  root.replaceChildren(
    el("h1", { id: "search-title", text: `Search ${id}` }),
    head,
    error,
    best,
    deployForm,
    deployed,
    el("div", { class: "charts" }, curvesDiv, spendDiv),
    el("h2", { text: "Parameters against the objective" }),
    parallel,
    el("h2", { text: "Importances" }),
    importances,
    el("h2", { text: "Trials" }),
    el("div", { class: "table-wrap" }, trials),
  );

  let doc = null;
  let curves = null;
  let spend = null;
  onLeave(() => {
    curves?.destroy();
    spend?.destroy();
  });

  deployForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!doc?.best?.job) {
      deployed.textContent = "no finished trial to deploy yet";
      return;
    }
    const answer = await api("/api/v1/deployments", { method: "POST", body: { job_id: doc.best.job, name: deployName.value } });
    deployed.textContent = answer.ok ? `deployment ${answer.data.name}: ${answer.data.state} (trial ${doc.best.trial}, job ${doc.best.job})` : detailText(answer);
  });

  poll(async () => {
    const answer = await api(`/api/v1/searches/${id}`);
    if (!answer.ok) {
      error.textContent = answer.status === 404 ? "not found" : detailText(answer);
      return answer.status !== 404;
    }
    error.textContent = "";
    doc = answer.data;
    const { metric, direction } = doc.objective;
    document.getElementById("search-title").textContent = `Search ${id}: ${doc.name}`;
    const budget = doc.budget;
    const left = [
      budget.usd != null && `${f.dollars(budget.usd_left)} of ${f.dollars(budget.usd)} left`,
      budget.hours != null && `${f.sig4(budget.hours_left)} of ${f.sig4(budget.hours)} device-hours left`,
    ].filter(Boolean);
    fill(
      head,
      badge(doc.state),
      ` ${metric} (${direction}) · ${doc.trials.length} of ${doc.max_trials} trials · spent ${f.dollars(doc.spent_usd)}, `,
      `${f.sig4(doc.device_hours)} device-hours`,
      left.length ? ` (${left.join("; ")})` : "",
      doc.reason ? ` · ${doc.reason}` : "",
    );
    best.textContent = doc.best
      ? `best: trial ${doc.best.trial} (job ${doc.best.job ?? "—"}), ${metric} ${f.sig4(doc.best.value)}, ${shownParams(doc.best.params)}`
      : "best: no finished trial yet";
    best.dataset.trial = doc.best ? String(doc.best.trial) : "";
    drawTrials(trials, doc);
    curves = drawCurves(curvesDiv, curves, doc, metric);
    spend = drawSpend(spendDiv, spend, doc, metric, direction);
    drawParallel(parallel, doc, metric);
    const shares = Object.entries(doc.importances);
    fill(
      importances.tBodies[0],
      shares.length
        ? shares.map(([k, v]) => el("tr", { "data-parameter": k }, el("td", { text: k }), el("td", {}, el("meter", { min: 0, max: 1, value: v }), ` ${f.pct(v)}`)))
        : el("tr", {}, el("td", { colspan: 2, text: "once 3 trials have finished" })),
    );
    return !ENDED.includes(doc.state);
  });
}

function drawTrials(t, doc) {
  fill(
    t.tBodies[0],
    doc.trials.map((r) =>
      el(
        "tr",
        { "data-trial": r.number, "data-state": r.state },
        el("td", { text: String(r.number) }),
        el("td", {}, r.job ? el("a", { href: `/jobs/${r.job}`, text: String(r.job) }) : "—"),
        el("td", {}, badge(r.state)),
        el("td", { text: shownParams(r.params) }),
        el("td", { class: "num", text: r.value == null ? "—" : f.sig4(r.value) }),
        el("td", { class: "num", text: r.steps == null ? "—" : String(r.steps) }),
        el("td", { class: "num", text: f.dollars(r.cost_usd) }),
        el("td", { text: r.reason ?? "" }),
      ),
    ),
  );
}

// Each trial's objective at its evaluations, on one chart; pruned and stopped trials faded.
function drawCurves(div, chart, doc, metric) {
  const withCurves = doc.trials.filter((t) => t.curve.length);
  const labels = withCurves.map((t) => `trial ${t.number}`);
  const colors = withCurves.map((t, i) => (t.state === "finished" || t.state === "running" ? PALETTE[i % PALETTE.length] : FADED));
  const key = labels.join(",") + colors.join(",");
  if (!chart || chart.key !== key) {
    chart?.destroy();
    chart = lineChart(div, { title: `${metric} at each evaluation`, metric, labels, colors });
    chart.key = key;
  }
  chart.setData(align(withCurves.map((t) => ({ step: t.curve.map((p) => p[0]), value: t.curve.map((p) => p[1]) }))));
  div.dataset.points = String(withCurves.reduce((n, t) => n + t.curve.length, 0));
  return chart;
}

// The best finished objective so far against the money the search had spent, trial by trial.
function drawSpend(div, chart, doc, metric, direction) {
  let spent = 0;
  let bestSoFar = null;
  const x = [];
  const y = [];
  for (const t of doc.trials) {
    spent += t.cost_usd ?? 0;
    if (t.state === "finished" && t.value != null) {
      bestSoFar = bestSoFar == null ? t.value : direction === "maximize" ? Math.max(bestSoFar, t.value) : Math.min(bestSoFar, t.value);
    }
    if (bestSoFar != null) {
      x.push(spent);
      y.push(bestSoFar);
    }
  }
  chart = chart ?? xyChart(div, { title: `best ${metric} against dollars spent`, xLabel: "spent", yLabel: metric, xFormat: f.dollars, labels: [`best ${metric}`] });
  chart.setData([x, y]);
  div.dataset.points = String(x.length);
  return chart;
}

// Parallel coordinates: an axis a parameter and one for the objective; a line a trial with a figure.
function drawParallel(div, doc, metric) {
  const names = Object.keys(doc.trials[0]?.params ?? {});
  const axes = [...names, metric];
  const rows = doc.trials.filter((t) => t.value != null);
  const width = 1000;
  const height = 260;
  const pad = 40;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height + 40}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", `parameters against ${metric}`);
  const scales = axes.map((name) => {
    const values = rows.map((t) => (name === metric ? t.value : t.params[name]));
    const numeric = values.every((v) => typeof v === "number");
    const logScale = numeric && values.every((v) => v > 0) && Math.max(...values) / Math.min(...values) > 50;
    const cats = numeric ? null : [...new Set(values.map(String))];
    const asNum = (v) => (cats ? cats.indexOf(String(v)) : logScale ? Math.log10(v) : v);
    const nums = values.map(asNum);
    const lo = Math.min(...nums);
    const hi = Math.max(...nums);
    return (v) => height - pad / 2 - ((asNum(v) - lo) / (hi - lo || 1)) * (height - pad);
  });
  const xOf = (i) => pad + (i * (width - 2 * pad)) / Math.max(1, axes.length - 1);
  axes.forEach((name, i) => {
    const line = document.createElementNS(SVG, "line");
    for (const [k, v] of Object.entries({ x1: xOf(i), x2: xOf(i), y1: pad / 2, y2: height - pad / 2, class: "axis" })) line.setAttribute(k, v);
    const label = document.createElementNS(SVG, "text");
    for (const [k, v] of Object.entries({ x: xOf(i), y: height + 20, "text-anchor": "middle", class: "axis-label" })) label.setAttribute(k, v);
    label.textContent = name;
    svg.append(line, label);
  });
  rows.forEach((t, n) => {
    const path = document.createElementNS(SVG, "polyline");
    const points = axes.map((name, i) => `${xOf(i)},${scales[i](name === metric ? t.value : t.params[name])}`).join(" ");
    path.setAttribute("points", points);
    path.setAttribute("class", `trial-line state-${t.state}`);
    path.setAttribute("stroke", t.state === "finished" ? PALETTE[n % PALETTE.length] : FADED);
    path.setAttribute("fill", "none");
    path.setAttribute("data-trial", t.number);
    const title = document.createElementNS(SVG, "title");
    title.textContent = `trial ${t.number} (${t.state}): ${shownParams(t.params)}, ${metric} ${f.sig4(t.value)}`;
    path.append(title);
    svg.append(path);
  });
  div.replaceChildren(svg);
  div.dataset.points = String(rows.length);
}
