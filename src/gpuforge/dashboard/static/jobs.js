// The jobs page (/): the list, 50 a page, polled; filters; row actions; the submit form; compare.
//
// Rows are kept by job id and updated in place at each poll, so that a checkbox ticked or a budget
// being typed into a row survives the refresh.

import { api, jobEnded, jobStates, poll, SignedOut } from "/static/app.js";
import { badge, detailText, el, fill, setText } from "/static/dom.js";
import * as f from "/static/format.js";

const PAGE = 50;
const MAX_COMPARE = 8; // what /api/v1/compare takes
// the cells a poll refreshes: td[data-field=<name>] and how its text is made from the job
const FIELDS = {
  owner: (j) => ownerName(j.owner) ?? "—",
  project: (j) => j.project ?? "—",
  queue: (j) => (j.queue_position ? `#${j.queue_position}` : "—"), // its place: 1 starts next
  devices: (j) => f.devices(j),
  step: (j) => f.steps(j.step, j.total_steps),
  loss: (j) => f.sig4(j.loss),
  samples_per_s: (j) => f.num(j.samples_per_s),
  mfu: (j) => f.pct(j.mfu),
  cost_usd: (j) => f.dollars(j.cost_usd),
  eta: (j) => (jobEnded(j.state) ? "—" : f.duration(j.eta_s)),
};

const NUMERIC = new Set(["step", "loss", "samples/s", "MFU", "cost", "ETA"]); // right-aligned headings
const ownerName = (o) => (o && typeof o === "object" ? o.name : o);

export async function render(root, { me, params }) {
  const readOnly = !!me.read_only;
  let offset = Math.max(0, parseInt(params.get("offset"), 10) || 0);
  const selected = new Set(); // ticked for compare, kept across pages and polls
  const rows = new Map(); // job id → {tr, state, cells}

  const stateFilter = el(
    "select",
    { name: "state" },
    el("option", { value: "", text: "all" }),
    jobStates().map((s) => el("option", { value: s, text: s })),
  );
  stateFilter.value = jobStates().includes(params.get("state")) ? params.get("state") : "";
  const ownerFilter = el("input", { name: "owner", type: "search", placeholder: "any owner", value: params.get("owner") ?? "" });
  const compareLink = el("a", { id: "compare-selected", class: "button" }, "Compare selected");
  const count = el("span", { id: "jobs-count" });
  const prev = el("button", { id: "jobs-prev", type: "button", text: "‹ Newer" });
  const next = el("button", { id: "jobs-next", type: "button", text: "Older ›" });
  const listError = el("p", { class: "error", role: "alert" });
  const empty = el("p", { class: "muted", text: "no jobs", hidden: true });
  const headings = ["", "id", "name", "state", "owner", "project", "queue", "devices", "step", "loss", "samples/s", "MFU", "cost", "ETA"];
  if (!readOnly) headings.push("actions");
  const table = el(
    "table",
    { id: "jobs" },
    el("thead", {}, el("tr", {}, headings.map((h) => el("th", { scope: "col", text: h, class: NUMERIC.has(h) ? "num" : null })))),
    el("tbody"),
  );

  fill(root,
    el("h1", { text: "Jobs" }),
    el(
      "div",
      { class: "toolbar" },
      el("label", {}, "State ", stateFilter),
      el("label", {}, "Owner ", ownerFilter),
      compareLink,
    ),
    listError,
    el("div", { class: "table-wrap" }, table),
    empty,
    el("div", { class: "pager" }, prev, count, next),
    readOnly ? null : submitForm(() => list.now()),
  );

  // --- the list ---
  async function refresh() {
    const q = new URLSearchParams({ limit: PAGE, offset });
    if (stateFilter.value) q.set("state", stateFilter.value);
    if (ownerFilter.value.trim()) q.set("owner", ownerFilter.value.trim());
    const answer = await api(`/api/v1/jobs?${q}`);
    if (!answer.ok) {
      listError.textContent = detailText(answer);
      return;
    }
    listError.textContent = "";
    const jobs = answer.data;
    const header = answer.headers.get("X-Total-Count");
    const total = header === null ? null : Number(header);
    if (jobs.length === 0 && offset > 0) {
      offset = 0; // the page emptied under us (filters, jobs gone): back to the first
      return list.now();
    }
    drawRows(jobs);
    empty.hidden = jobs.length > 0;
    const last = offset + jobs.length;
    const of = total === null ? "" : ` of ${total}`;
    setText(count, jobs.length ? `${offset + 1}–${last}${of}` : `0${of}`);
    prev.disabled = offset === 0;
    next.disabled = total === null ? jobs.length < PAGE : last >= total;
  }

  function drawRows(jobs) {
    const tbody = table.tBodies[0];
    const wanted = new Set(jobs.map((j) => j.id));
    for (const [id, row] of rows) {
      if (!wanted.has(id)) {
        row.tr.remove();
        rows.delete(id);
      }
    }
    jobs.forEach((job, i) => {
      let row = rows.get(job.id);
      if (!row) {
        row = newRow(job);
        rows.set(job.id, row);
      }
      updateRow(row, job);
      // insert where it belongs without moving the rows already in place (a focused input stays)
      if (tbody.children[i] !== row.tr) tbody.insertBefore(row.tr, tbody.children[i] ?? null);
    });
  }

  function newRow(job) {
    const cells = {};
    const td = (field) => (cells[field] = el("td", { "data-field": field }));
    const tick = el("input", {
      type: "checkbox",
      name: "compare",
      value: job.id,
      checked: selected.has(job.id),
      "aria-label": `compare job ${job.id}`,
      onchange: (e) => {
        if (e.target.checked) selected.add(job.id);
        else selected.delete(job.id);
        drawCompareLink();
      },
    });
    const tr = el(
      "tr",
      { "data-job-id": job.id },
      el("td", {}, tick),
      el("td", { "data-field": "id" }, el("a", { href: `/jobs/${job.id}`, text: job.id })),
      td("name"),
      td("state"),
      Object.keys(FIELDS).map(td),
      readOnly ? null : td("actions"),
    );
    return { tr, cells, state: null };
  }

  function updateRow(row, job) {
    const { cells } = row;
    const name = cells.name.firstChild ?? cells.name.appendChild(el("a", { href: `/jobs/${job.id}` }));
    setText(name, job.name);
    // the reason (why it waits, failed, paused) under the name: the first thing one asks of a job
    let reason = cells.name.querySelector(".reason");
    if (job.reason && !reason) reason = cells.name.appendChild(el("div", { class: "reason" }));
    if (reason) setText(reason, job.reason ?? "");
    for (const [field, text] of Object.entries(FIELDS)) setText(cells[field], text(job));
    if (row.state !== job.state) {
      cells.state.replaceChildren(badge(job.state));
      if (!readOnly) drawActions(cells.actions, job);
      row.state = job.state;
    }
    cells.state.title = job.reason ?? "";
  }

  // --- row actions: cancel, resume (with a new budget), deploy (with a name) ---
  function drawActions(cell, job) {
    cell.replaceChildren();
    if (!jobEnded(job.state)) {
      const b = el("button", { type: "button", "data-action": "cancel", text: "Cancel" });
      b.addEventListener("click", () =>
        act(cell, b, () => api(`/api/v1/jobs/${job.id}/cancel`, { method: "POST" }), () => {
          b.textContent = "Cancelling…"; // a running job ends when its runner has checkpointed
          b.disabled = true;
          return true;
        }),
      );
      cell.append(b);
    }
    if (job.state === "paused") {
      cell.append(
        inlineAction(cell, "resume", "Resume…", () => {
          const budget = el("input", {
            name: "budget_usd",
            type: "number",
            min: "0",
            step: "any",
            placeholder: "budget $ (empty: none)",
            "aria-label": "new budget in dollars",
          });
          const send = () => {
            const text = budget.value.trim();
            return api(`/api/v1/jobs/${job.id}/resume`, {
              method: "POST",
              body: { budget_usd: text === "" ? null : Number(text) },
            });
          };
          return [budget, "resume-confirm", "Resume", send];
        }),
      );
    }
    if (job.state === "finished") {
      cell.append(
        inlineAction(cell, "deploy", "Deploy…", () => {
          const name = el("input", {
            name: "deployment_name",
            type: "text",
            required: true,
            maxlength: "100",
            value: job.name.replace(/[^A-Za-z0-9._-]/g, "-").replace(/^[^A-Za-z0-9]+/, "") || `job-${job.id}`,
            "aria-label": "deployment name",
          });
          const send = () =>
            api("/api/v1/deployments", {
              method: "POST",
              body: { job_id: job.id, name: name.value.trim(), replicas: 1 },
            });
          const done = () => {
            note(cell, "deployed as ", el("a", { href: "/deployments", text: name.value.trim() }));
            return true;
          };
          return [name, "deploy-confirm", "Deploy", send, done];
        }),
      );
    }
  }

  // A button that opens a small form in the row (an input and a confirm button); again: closes it.
  function inlineAction(cell, action, label, make) {
    const open = el("button", { type: "button", "data-action": action, text: label });
    let form = null;
    open.addEventListener("click", () => {
      if (form) {
        form.remove();
        form = null;
        return;
      }
      const [input, confirmAction, confirmLabel, send, done] = make();
      const confirm = el("button", { type: "submit", "data-action": confirmAction, text: confirmLabel });
      form = el("form", { class: "inline" }, input, confirm);
      form.addEventListener("submit", (e) => {
        e.preventDefault();
        act(cell, confirm, send, done);
      });
      open.after(form);
      input.focus();
    });
    return open;
  }

  // Send an action; its error (the API's detail) goes into the row, a success refreshes the list.
  async function act(cell, button, send, done) {
    for (const old of cell.querySelectorAll(".row-error, .row-note")) old.remove();
    button.disabled = true;
    let keep = false;
    try {
      const answer = await send();
      if (answer.ok) {
        keep = done ? done(answer) : false;
        list.now();
      } else {
        cell.append(el("div", { class: "row-error", role: "alert", text: detailText(answer) }));
      }
    } catch (err) {
      if (!(err instanceof SignedOut)) cell.append(el("div", { class: "row-error", text: `cannot reach the server (${err.message})` }));
    } finally {
      if (!keep) button.disabled = false;
    }
  }

  function note(cell, ...parts) {
    cell.append(el("div", { class: "row-note" }, ...parts));
  }

  // --- compare: 2 to 8 ticked jobs ---
  function drawCompareLink() {
    const ids = [...selected].sort((a, b) => a - b);
    const ok = ids.length >= 2 && ids.length <= MAX_COMPARE;
    compareLink.textContent = ids.length ? `Compare selected (${ids.length})` : "Compare selected";
    compareLink.classList.toggle("disabled", !ok);
    compareLink.title = ids.length > MAX_COMPARE ? `at most ${MAX_COMPARE} jobs` : ok ? "" : "tick 2 jobs or more";
    if (ok) {
      compareLink.href = `/compare?ids=${ids.join(",")}`;
      compareLink.removeAttribute("aria-disabled");
    } else {
      compareLink.removeAttribute("href");
      compareLink.setAttribute("aria-disabled", "true");
    }
  }

  // --- filters and pages: kept in the URL, so that a reload or a link shows the same list ---
  function filtersChanged() {
    const q = new URLSearchParams();
    if (stateFilter.value) q.set("state", stateFilter.value);
    if (ownerFilter.value.trim()) q.set("owner", ownerFilter.value.trim());
    if (offset) q.set("offset", offset);
    history.replaceState(null, "", q.toString() ? `/?${q}` : "/");
    list.now();
  }
  let typing = null;
  stateFilter.addEventListener("change", () => {
    offset = 0;
    filtersChanged();
  });
  ownerFilter.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => {
      offset = 0;
      filtersChanged();
    }, 300);
  });
  prev.addEventListener("click", () => {
    offset = Math.max(0, offset - PAGE);
    filtersChanged();
  });
  next.addEventListener("click", () => {
    offset += PAGE;
    filtersChanged();
  });

  drawCompareLink();
  const list = poll(refresh);
}

// A file the spec names that lies on the user's machine, not under the server's data roots: this page
// sends the spec's text alone, while `gpuforge submit` uploads the files a spec names.
const OUTSIDE_ROOTS = /is outside the server's data roots/;
const UPLOAD_HINT =
  "A file on your own machine? Submit this spec with `gpuforge submit SPEC.yaml`: it uploads the files " +
  "the spec names (this page sends the spec's text alone). Or name a file under one of those roots.";
function withHint(message) {
  return OUTSIDE_ROOTS.test(message) ? `${message}\n\n${UPLOAD_HINT}` : message;
}

// The submit form: a spec pasted, or read from a file into the same box; the API's refusal beside it.
function submitForm(submitted) {
  const spec = el("textarea", {
    name: "spec",
    rows: 14,
    spellcheck: "false",
    placeholder: "name: my-job\nmodel:\n  source: ...\n(paste a job spec, YAML)",
    "aria-label": "job spec (YAML)",
  });
  const error = el("div", { id: "spec-error", role: "alert" });
  const file = el("input", { type: "file", name: "spec_file", accept: ".yaml,.yml,.json,text/yaml,application/json" });
  const button = el("button", { type: "submit", text: "Submit" });
  const done = el("span", { id: "submit-note", class: "muted" });
  const form = el(
    "form",
    { id: "submit" },
    el("h2", { text: "Submit a job" }),
    el("div", { class: "spec-row" }, spec, error),
    el("div", { class: "submit-bar" }, el("label", {}, "or read a file: ", file), button, done),
  );

  file.addEventListener("change", async () => {
    if (file.files.length) spec.value = await file.files[0].text();
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    button.disabled = true;
    done.textContent = "";
    try {
      const answer = await api("/api/v1/jobs", { method: "POST", body: { spec: spec.value } });
      if (answer.ok) {
        error.textContent = "";
        done.replaceChildren("queued ", el("a", { href: `/jobs/${answer.data.id}`, text: `job ${answer.data.id}` }));
        submitted();
      } else {
        error.textContent = withHint(detailText(answer)); // 422 (the spec), 413 (too large), 429 (quota)
      }
    } catch (err) {
      if (!(err instanceof SignedOut)) error.textContent = `cannot reach the server (${err.message})`;
    } finally {
      button.disabled = false;
    }
  });
  return form;
}
