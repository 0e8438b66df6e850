// A job's profile section (train.profile, or `gpuforge profile JOB --steps N`): the mean step as a stacked
// bar of its parts (and the slowest rank's beside rank 0's), the advice, the top operators, and the trace
// to save for Perfetto, fetched with the key (never a link that carries it).

import { api, fetchFile } from "/static/app.js";
import { PALETTE } from "/static/charts.js";
import { el } from "/static/dom.js";
import * as f from "/static/format.js";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 1000; // the bar's own units: it scales to the page

// The section, or null while the run has no profile (or one the server cannot read: its detail).
export async function profileSection(id) {
  const answer = await api(`/api/v1/jobs/${id}/profile`);
  if (answer.status === 404) return null;
  if (!answer.ok) return el("section", { id: "profile" }, el("h2", { text: "Profile" }), el("p", { class: "error", text: String(answer.data?.detail ?? answer.status) }));
  const p = answer.data;
  const steps = p.steps ?? [];
  const parts = Object.entries(p.breakdown).filter(([, v]) => v.seconds > 0).sort((a, b) => b[1].share - a[1].share);
  const colors = new Map(parts.map(([name], i) => [name, PALETTE[i % PALETTE.length]]));
  const title = `mean step ${f.sig4(p.mean_step_s * 1000)} ms over ${steps.length} steps from step ${steps[0]?.step ?? "?"} (${p.device})`;
  const bars = [bar(`rank ${p.rank ?? 0}`, p.breakdown, colors)];
  const slowest = p.slowest_rank;
  if (slowest && slowest.rank !== (p.rank ?? 0)) {
    bars.push(bar(`rank ${slowest.rank}, the slowest: ${f.sig4(slowest.mean_step_s * 1000)} ms`, slowest.breakdown, colors));
  }
  const legend = el(
    "ul",
    { class: "legend" },
    parts.map(([name, v]) =>
      el("li", { "data-part": name }, swatch(colors.get(name)), ` ${name.replaceAll("_", " ")} ${f.pct(v.share)} (${f.sig4(v.seconds * 1000)} ms)`),
    ),
  );
  const comm = p.all_reduce;
  const commLine = comm
    ? el("p", { id: "profile-comm", text: `gradient all-reduce ${f.pct(comm.share)} of the step (overlaps backward), ${f.bytes(comm.bytes)} a step${comm.bandwidth_bytes_per_s ? `, ${f.sig4((comm.bandwidth_bytes_per_s * 8) / 1e6)} Mbit/s` : ""}` })
    : null;
  const advice = el("ul", { id: "profile-advice" }, (p.advice?.length ? p.advice : ["none: no share is out of line"]).map((line) => el("li", { text: line })));
  const onDevice = p.device === "cuda";
  const ops = el(
    "table",
    { id: "profile-operators" },
    el("thead", {}, el("tr", {}, ["operator", "calls a step", "ms", "share"].map((h, i) => el("th", { text: h, class: i ? "num" : null })))),
    el(
      "tbody",
      {},
      (p.top_operators ?? []).slice(0, 10).map((row) =>
        el(
          "tr",
          {},
          el("td", { text: row.name }),
          el("td", { class: "num", text: f.num(row.calls) }),
          el("td", { class: "num", text: f.sig4((onDevice ? row.self_device_s : row.self_cpu_s) * 1000) }),
          el("td", { class: "num", text: f.pct(row.share) }),
        ),
      ),
    ),
  );
  const status = el("span", { class: "muted" });
  const save = el("button", { id: "profile-trace", type: "button", text: "save the trace", onclick: () => saveTrace(id, p.trace, status) });
  const notes = [p.trace_note, p.cut_short ? "the run ended inside the window" : null].filter(Boolean).map((n) => el("p", { class: "muted", text: `note: ${n}` }));
  return el(
    "section",
    { id: "profile" },
    el("h2", { text: "Profile" }),
    el("p", { id: "profile-title", text: title }),
    ...bars,
    legend,
    commLine,
    el("h3", { text: "Advice" }),
    advice,
    el("div", { class: "table-wrap" }, ops),
    el("p", {}, save, " ", status, el("span", { class: "muted", text: " open it in Perfetto (ui.perfetto.dev, Open trace file) or chrome://tracing: it stays on your machine" })),
    ...notes,
  );
}

// One stacked bar: a rect per part, as wide as its share of the step.
function bar(label, breakdown, colors) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", `0 0 ${WIDTH} 24`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "stack");
  svg.setAttribute("role", "img");
  let x = 0;
  const parts = Object.entries(breakdown).filter(([, v]) => v.seconds > 0).sort((a, b) => b[1].share - a[1].share);
  for (const [name, v] of parts) {
    const rect = document.createElementNS(SVG, "rect");
    const w = Math.max(0, v.share * WIDTH);
    for (const [k, value] of [["x", x], ["y", 0], ["width", w], ["height", 24], ["fill", colors.get(name) ?? "#9ca3af"], ["data-part", name]]) {
      rect.setAttribute(k, String(value));
    }
    const tip = document.createElementNS(SVG, "title");
    tip.textContent = `${name.replaceAll("_", " ")} ${f.pct(v.share)}`;
    rect.append(tip);
    svg.append(rect);
    x += w;
  }
  svg.setAttribute("aria-label", `${label}: ${parts.map(([n, v]) => `${n} ${f.pct(v.share)}`).join(", ")}`);
  return el("figure", { class: "stack" }, el("figcaption", { class: "muted", text: label }), svg);
}

function swatch(color) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 10 10");
  svg.setAttribute("class", "swatch");
  const rect = document.createElementNS(SVG, "rect");
  for (const [k, v] of [["width", 10], ["height", 10], ["fill", color]]) rect.setAttribute(k, String(v));
  svg.append(rect);
  return svg;
}

// The trace through the API with the key, saved by the browser under the job's name.
async function saveTrace(id, name, status) {
  status.textContent = "fetching …";
  const response = await fetchFile(`/api/v1/jobs/${id}/profile/trace`);
  if (!response.ok) {
    status.textContent = `not saved: HTTP ${response.status}`;
    return;
  }
  const url = URL.createObjectURL(await response.blob());
  const link = el("a", { href: url, download: `job-${id}-${name || "trace.json.gz"}` });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
  status.textContent = "saved";
}
