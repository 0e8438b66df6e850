// Thin wrappers over uPlot (the global the classic script vendor/uPlot.iife.min.js defines).
// Each chart lives in a div.chart the caller made; it follows the div's width, and the caller updates it
// in place with setData (no new canvas per poll) and calls destroy when the page is left.

import { bytes, dollars, pct, sig4, ticks } from "/static/format.js";

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
const HEIGHT = 220;
// tick spacings for byte axes: round numbers of B, KiB, MiB, GiB, ... (0.2 MiB, not 200 KiB read as MiB)
const BYTE_INCRS = [0, 1, 2, 3, 4, 5].flatMap((k) =>
  [0.1, 0.2, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500].filter((m) => k > 0 || m >= 1).map((m) => m * 1024 ** k),
);
// tick spacings for steps: whole steps only
const STEP_INCRS = [0, 1, 2, 3, 4, 5, 6, 7, 8].flatMap((k) => [1, 2, 5].map((m) => m * 10 ** k));
const AFTER_EVALS = ["samples_per_s", "mfu", "peak_mem_bytes", "step_cost_usd"];

// The metrics a page charts, in this order: loss, each eval_* (eval_loss first), then throughput, MFU,
// memory and cost, of those in `names` (and in `only`, where given). `all`: every other name too, by
// name (a script job's figures are its own; a spec job's others, lr, eta_s, ..., stay off the page).
export function chartedMetrics(names, only = null, all = false) {
  const evals = names
    .filter((n) => n.startsWith("eval_"))
    .sort((a, b) => (a === "eval_loss" ? -1 : b === "eval_loss" ? 1 : a.localeCompare(b)));
  const ordered = [...(names.includes("loss") ? ["loss"] : []), ...evals, ...AFTER_EVALS.filter((n) => names.includes(n))];
  if (all) ordered.push(...names.filter((n) => !ordered.includes(n)).sort());
  return only ? ordered.filter((n) => only(n)) : ordered;
}
const AXIS = { stroke: "#4b5563", grid: { stroke: "#e5e7eb", width: 1 }, ticks: { stroke: "#d1d5db", width: 1 } };
// a y axis as wide as its longest label ("399.80 MiB" needs more room than "0.5")
const Y_AXIS = { ...AXIS, size: (u, values) => 24 + 7 * Math.max(3, ...(values ?? []).map((v) => String(v).length)) };

// uPlot sized to `div`, resized with it; {u, setData, destroy}.
function mount(div, opts, data) {
  const width = () => {
    const pad = getComputedStyle(div);
    const inner = div.clientWidth - parseFloat(pad.paddingLeft || 0) - parseFloat(pad.paddingRight || 0);
    return Math.max(200, Math.floor(inner || 400));
  };
  const u = new uPlot({ width: width(), height: HEIGHT, ...opts }, data, div);
  const resize = new ResizeObserver(() => {
    if (Math.abs(u.width - width()) > 1) u.setSize({ width: width(), height: HEIGHT });
  });
  resize.observe(div);
  return {
    u,
    setData: (d) => u.setData(d),
    destroy() {
      resize.disconnect();
      u.destroy();
    },
  };
}

// Lines of one or more series over a shared x (the step): data is [steps, ys of series 1, ...], with
// nulls where a series has no point at that step (gaps are spanned: runs log at different steps).
// `sync` ties the cursors of the charts of one page together.
export function lineChart(div, { title, metric, labels, colors, sync }) {
  const fmt = metric === "mfu" ? pct : metric.endsWith("_bytes") ? bytes : metric.includes("usd") ? dollars : sig4;
  const series = labels.map((label, i) => ({
    label,
    stroke: colors?.[i] ?? PALETTE[i % PALETTE.length],
    width: 1.5,
    spanGaps: true,
    value: (u, v) => (v === null || v === undefined ? "—" : fmt(v)),
  }));
  const opts = {
    title,
    // one step alone (a first eval) gets a step either side, not 0 to twice its step (uPlot's padding)
    scales: { x: { time: false, range: (u, lo, hi) => (oneX(u) ? [u.data[0][0] - 1, u.data[0][0] + 1] : [lo, hi]) } },
    series: [{ label: "step", value: (u, v) => (v === null || v === undefined ? "—" : String(v)) }, ...series],
    axes: [{ ...AXIS, incrs: STEP_INCRS }, { ...Y_AXIS, values: ticks(metric), ...(metric.endsWith("_bytes") ? { incrs: BYTE_INCRS } : {}) }],
    cursor: sync ? { sync: { key: sync } } : {},
  };
  return mount(div, opts, [[], ...labels.map(() => [])]);
}

const oneX = (u) => u.data[0].length > 0 && u.data[0][0] === u.data[0][u.data[0].length - 1];

// One [x, y] table per run, aligned on the union of their x values (uPlot draws one x for all series).
export function align(tables) {
  if (tables.length === 0) return [[]];
  return uPlot.join(tables.map((t) => [t.step, t.value]));
}

// The compression report: disk size (x) against the metric (y), points only, Pareto ones in colour.
export function reportChart(div, variants) {
  const rows = [...variants].filter((v) => v.disk_bytes != null).sort((a, b) => a.disk_bytes - b.disk_bytes);
  const metricName = rows.find((v) => v.metric?.name)?.metric.name ?? "metric";
  const x = rows.map((v) => v.disk_bytes);
  const y = (pareto) => rows.map((v) => (!!v.pareto === pareto ? v.metric?.value ?? null : null));
  const dot = (color, size) => ({ show: true, size, fill: color, stroke: color });
  const opts = {
    title: `${metricName} against size on disk`,
    scales: {
      x: { time: false, range: (u, lo, hi) => padded(lo, hi) },
      y: { range: (u, lo, hi) => padded(lo, hi) },
    },
    series: [
      { label: "variant", value: (u, v, s, i) => (i === null || i === undefined ? "—" : `${rows[i].name}, ${bytes(v)}`) },
      { label: "Pareto", stroke: PALETTE[0], paths: () => null, points: dot(PALETTE[0], 10) },
      { label: "other", stroke: "#9ca3af", paths: () => null, points: dot("#9ca3af", 8) },
    ],
    axes: [
      { ...AXIS, values: ticks("disk_bytes"), incrs: BYTE_INCRS, size: 40 },
      { ...Y_AXIS, values: ticks("metric") },
    ],
  };
  return { chart: mount(div, opts, [x, y(true), y(false)]), points: rows.length };
}

// A scale from lo to hi with room around it, so that no point sits on the frame (one point: ±10%).
function padded(lo, hi) {
  if (lo === null || hi === null) return [0, 1];
  const span = hi - lo || Math.abs(hi) * 0.2 || 1;
  return [lo - span * 0.1, hi + span * 0.1];
}

// Spend per day: a bar a day (x: the day's Unix time, UTC midnight).
export function costChart(div, days, totals) {
  const x = days.map((d) => Date.parse(`${d}T00:00:00Z`) / 1000);
  const opts = {
    title: "spend per day",
    // half a day either side: a bar is centred on its day, so the first and the last are drawn whole
    scales: { x: { time: true, range: (u, lo, hi) => [(lo ?? hi) - 43200, (hi ?? lo) + 43200] } },
    series: [
      { label: "day", value: (u, v) => (v === null || v === undefined ? "—" : new Date(v * 1000).toISOString().slice(0, 10)) },
      {
        label: "total",
        stroke: PALETTE[0],
        fill: "rgba(37, 99, 235, 0.35)",
        paths: uPlot.paths.bars({ size: [0.7, 40] }),
        points: { show: false },
        value: (u, v) => dollars(v),
      },
    ],
    axes: [{ ...AXIS }, { ...Y_AXIS, values: ticks("usd") }],
  };
  return mount(div, opts, [x, totals]);
}

// y against a numeric x that is not a step (dollars spent, say): one or more series, lines and points.
export function xyChart(div, { title, xLabel, yLabel, xFormat = sig4, yFormat = sig4, labels }) {
  const series = labels.map((label, i) => ({
    label,
    stroke: PALETTE[i % PALETTE.length],
    width: 1.5,
    spanGaps: true,
    points: { show: true, size: 6 },
    value: (u, v) => (v === null || v === undefined ? "—" : yFormat(v)),
  }));
  const opts = {
    title,
    scales: { x: { time: false, range: (u, lo, hi) => padded(lo, hi) }, y: { range: (u, lo, hi) => padded(lo, hi) } },
    series: [{ label: xLabel, value: (u, v) => (v === null || v === undefined ? "—" : xFormat(v)) }, ...series],
    axes: [{ ...AXIS, values: (u, vals) => vals.map(xFormat) }, { ...Y_AXIS, label: yLabel, values: (u, vals) => vals.map(yFormat) }],
  };
  return mount(div, opts, [[], ...labels.map(() => [])]);
}
