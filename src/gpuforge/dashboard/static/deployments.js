// Deployments (/deployments): each deployment with its replicas' live figures (polled), undeploy, and a
// box to try one: inputs in, its JSON answer out.

import { api, deploymentEnded, poll, SignedOut } from "/static/app.js";
import { badge, detailText, el, setText } from "/static/dom.js";
import * as f from "/static/format.js";

const SERVING = new Set(["starting", "ready"]); // replicas up: their stats are worth asking for

export async function render(root) {
  const showEnded = el("input", { type: "checkbox", name: "all" });
  const table = el(
    "table",
    { id: "deployments" },
    el(
      "thead",
      {},
      el("tr", {}, ["name", "version", "state", "job", "replicas ready", "req/s", "p50 / p99 ms", "refused", "actions"].map((h, i) =>
          el("th", { text: h, class: i >= 4 && i <= 7 ? "num" : null }),
        )),
    ),
    el("tbody"),
  );
  const error = el("p", { class: "error", role: "alert" });
  const empty = el("p", { class: "muted", text: "no deployments", hidden: true });
  const rows = new Map(); // name → {tr, cells, state}
  const tryBox = tryForm();
  root.replaceChildren(
    el("h1", { text: "Deployments" }),
    el("div", { class: "toolbar" }, el("label", {}, showEnded, " show stopped and failed ones")),
    error,
    el("div", { class: "table-wrap" }, table),
    empty,
    tryBox.form,
  );

  async function refresh() {
    const answer = await api(`/api/v1/deployments${showEnded.checked ? "?all=true" : ""}`);
    if (!answer.ok) {
      error.textContent = detailText(answer);
      return;
    }
    error.textContent = "";
    const deployments = answer.data;
    // every serving deployment's stats at once; one that does not answer shows "—"
    const stats = await Promise.all(
      deployments.map(async (d) => {
        if (!SERVING.has(d.state)) return null;
        const s = await api(`/api/v1/deployments/${encodeURIComponent(d.name)}/stats`).catch((err) => {
          if (err instanceof SignedOut) throw err;
          return null;
        });
        return s?.ok ? s.data : null;
      }),
    );
    const tbody = table.tBodies[0];
    const seen = new Set(deployments.map((d) => d.name));
    for (const [name, row] of rows) {
      if (!seen.has(name)) {
        row.tr.remove();
        rows.delete(name);
      }
    }
    deployments.forEach((d, i) => {
      let row = rows.get(d.name);
      if (!row) rows.set(d.name, (row = newRow(d)));
      updateRow(row, d, stats[i]);
      if (tbody.children[i] !== row.tr) tbody.insertBefore(row.tr, tbody.children[i] ?? null);
    });
    empty.hidden = deployments.length > 0;
    tryBox.offer(deployments.filter((d) => !deploymentEnded(d.state)).map((d) => d.name));
  }

  function newRow(d) {
    const cells = {};
    const td = (field, cls) => (cells[field] = el("td", { "data-field": field, class: cls }));
    const tr = el(
      "tr",
      { "data-deployment": d.name },
      td("name"),
      td("version"),
      td("state"),
      td("job"),
      td("replicas", "num"),
      td("requests_per_s", "num"),
      td("latency", "num"),
      td("refused", "num"),
      td("actions"),
    );
    return { tr, cells, state: null };
  }

  function updateRow(row, d, stats) {
    const { cells } = row;
    setText(cells.name, d.name);
    cells.name.title = d.model_dir ?? "";
    setText(cells.version, versionText(d));
    const ready = (d.workers || []).filter((w) => w.ready).length;
    setText(cells.replicas, `${ready}/${d.replicas}`);
    const replicas = stats?.replicas ?? [];
    const sum = (k) => (replicas.length ? replicas.reduce((n, r) => n + (Number(r[k]) || 0), 0) : null);
    const worst = (k) => {
      const known = replicas.map((r) => r[k]).filter((v) => v != null);
      return known.length ? Math.max(...known) : null;
    };
    setText(cells.requests_per_s, f.num(sum("requests_per_s")));
    setText(cells.latency, `${f.num(worst("p50_ms"))} / ${f.num(worst("p99_ms"))}`);
    setText(cells.refused, f.num(sum("refused")));
    // a replica with no device free says who holds each one: shown where the deployment's reason would be
    const waiting = (d.workers || []).map((w) => w.waiting).find(Boolean);
    const why = d.reason || (waiting ? `replica waiting: ${waiting}` : null);
    if (row.state !== d.state || row.reason !== why) {
      cells.state.replaceChildren(badge(d.state), why ? el("div", { class: "reason", text: why }) : "");
      cells.job.replaceChildren(d.job_id ? el("a", { href: `/jobs/${d.job_id}`, text: `job ${d.job_id}` }) : "—");
      drawActions(cells.actions, d);
      row.state = d.state;
      row.reason = why;
    }
  }

  function drawActions(cell, d) {
    cell.replaceChildren();
    if (deploymentEnded(d.state) || d.state === "stopping") return;
    const b = el("button", { type: "button", "data-action": "undeploy", text: "Undeploy" });
    b.addEventListener("click", async () => {
      for (const old of cell.querySelectorAll(".row-error")) old.remove();
      b.disabled = true;
      try {
        const answer = await api(`/api/v1/deployments/${encodeURIComponent(d.name)}`, { method: "DELETE" });
        if (answer.ok) b.textContent = "Stopping…";
        else {
          cell.append(el("div", { class: "row-error", role: "alert", text: detailText(answer) }));
          b.disabled = false;
        }
        list.now();
      } catch (err) {
        if (err instanceof SignedOut) return;
        cell.append(el("div", { class: "row-error", text: `cannot reach the server (${err.message})` }));
        b.disabled = false;
      }
    });
    cell.append(b);
  }

  showEnded.addEventListener("change", () => list.now());
  const list = poll(refresh);
}

// The try box: a deployment, inputs (a text a line, or a JSON value), and what it answered.
function tryForm() {
  const pick = el("select", { name: "deployment", "aria-label": "deployment" });
  const input = el("textarea", {
    name: "input",
    rows: 5,
    spellcheck: "false",
    placeholder: 'one text a line\n(or JSON: ["a", "b"] for the inputs, {"inputs": ...} for the whole request)',
    "aria-label": "inputs",
  });
  const send = el("button", { type: "submit", "data-action": "predict", text: "Predict" });
  const out = el("pre", { id: "predict-answer" });
  const form = el(
    "form",
    { id: "try", class: "try" },
    el("h2", { text: "Try a deployment" }),
    el("label", {}, "Deployment ", pick),
    input,
    el("div", {}, send),
    out,
  );
  let offered = "";

  // The live deployments to pick from; the one picked stays picked across polls.
  function offer(names) {
    if (names.join("\n") === offered) return;
    offered = names.join("\n");
    const was = pick.value;
    pick.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
    if (names.includes(was)) pick.value = was;
    send.disabled = names.length === 0;
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    let body;
    try {
      body = requestBody(input.value);
    } catch (err) {
      out.textContent = `input: not valid JSON (${err.message})`;
      return;
    }
    send.disabled = true;
    out.textContent = "…";
    try {
      const answer = await api(`/api/v1/deployments/${encodeURIComponent(pick.value)}/predict`, { method: "POST", body });
      out.textContent = answer.ok ? JSON.stringify(answer.data, rounded, 2) : `${answer.status}: ${detailText(answer)}`;
    } catch (err) {
      if (!(err instanceof SignedOut)) out.textContent = `cannot reach the server (${err.message})`;
    } finally {
      send.disabled = pick.options.length === 0;
    }
  });
  return { form, offer };
}

// The version serving, and the one rolling out beside it: "v2", "v2 (v3 rolling out)".
function versionText(d) {
  if (d.version == null) return "—";
  return d.rolling_version != null ? `v${d.version} (v${d.rolling_version} rolling out)` : `v${d.version}`;
}

// A JSON.stringify replacer: a score reads 0.9731, not 0.97312045097351074.
function rounded(key, value) {
  return typeof value === "number" && !Number.isInteger(value) ? Number(value.toPrecision(4)) : value;
}

// Lines → {"inputs": [lines]}; a JSON list → {"inputs": list}; a JSON object → the request as it is.
function requestBody(text) {
  const t = text.trim();
  if (t.startsWith("[") || t.startsWith("{")) {
    const value = JSON.parse(t);
    return Array.isArray(value) ? { inputs: value } : value;
  }
  return { inputs: text.split("\n").map((l) => l.trim()).filter((l) => l !== "") };
}
