// The audit log (/audit): who changed what, when, from where, before and after; newest first, filtered by
// project, key and action, a page of 100 at a time ("Older" asks for the next). An admin key reads every
// row, a maintainer its project's; anyone else is told so (the server's 403). Every text is put in as text.

import { api, SignedOut } from "/static/app.js";
import { detailText, el, fill } from "/static/dom.js";

const PAGE = 100;

export async function render(root, { params }) {
  const field = (name, label, placeholder) => {
    const input = el("input", { name, placeholder, maxlength: name === "action" ? 40 : 100 });
    input.value = params.get(name) ?? "";
    return el("label", {}, `${label} `, input);
  };
  const form = el(
    "form",
    { id: "audit-filter", class: "toolbar" },
    field("project", "Project", "all"),
    field("actor", "Key", "anyone"),
    field("action", "Action", "jobs.cancel"),
    el("button", { type: "submit", text: "Show" }),
  );
  const error = el("p", { class: "error", role: "alert" });
  const body = el("tbody");
  const older = el("button", { type: "button", id: "audit-older", text: "Older", hidden: true });
  const table = el(
    "table",
    { id: "audit" },
    el("thead", {}, el("tr", {}, ["id", "at (UTC)", "key", "from", "action", "on", "project", "change"].map((c) => el("th", { text: c })))),
    body,
  );
  root.replaceChildren(el("h1", { text: "Audit log" }), form, error, el("div", { class: "table-wrap" }, table), older);

  let oldest = null;
  async function load(more) {
    const q = new URLSearchParams({ limit: String(PAGE) });
    for (const name of ["project", "actor", "action"]) {
      const value = form.elements[name].value.trim();
      if (value) q.set(name, value);
    }
    if (!more) history.replaceState(null, "", `/audit?${new URLSearchParams([...q].filter(([k]) => k !== "limit"))}`);
    if (more && oldest !== null) q.set("before", String(oldest));
    const answer = await api(`/api/v1/audit?${q}`);
    if (!answer.ok) {
      error.textContent = detailText(answer);
      if (!more) body.replaceChildren();
      older.hidden = true;
      return;
    }
    error.textContent = "";
    const rows = answer.data;
    const drawn = rows.map((r) =>
      el(
        "tr",
        { "data-id": r.id, class: r.outcome === "done" ? null : "refused" },
        el("td", { class: "num", text: String(r.id) }),
        el("td", { text: r.at.slice(0, 19).replace("T", " ") }),
        el("td", { text: r.actor }),
        el("td", { text: r.source }),
        el("td", {}, el("code", { text: r.action })),
        el("td", { text: r.target }),
        el("td", { text: r.project ?? "" }),
        el("td", { text: (r.outcome === "done" ? "" : `${r.outcome}: `) + changeText(r.before, r.after) }),
      ),
    );
    if (more) body.append(...drawn);
    else fill(body, ...drawn);
    if (rows.length) oldest = rows[rows.length - 1].id;
    older.hidden = rows.length < PAGE;
    if (!more && !rows.length) fill(body, el("tr", {}, el("td", { colspan: 8, class: "muted", text: "no row" })));
  }

  const guarded = (more) =>
    load(more).catch((err) => {
      if (!(err instanceof SignedOut)) error.textContent = `cannot reach the server (${err.message})`;
    });
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    oldest = null;
    guarded(false);
  });
  older.addEventListener("click", () => guarded(true));
  await load(false);
}

// before -> after, field by field: those that differ where both are given, every one where only one is.
function changeText(before, after) {
  const b = before ?? {};
  const a = after ?? {};
  const show = (v) => (v === null || v === undefined ? "none" : typeof v === "object" ? JSON.stringify(v) : String(v));
  return Object.keys({ ...b, ...a })
    .filter((k) => !(k in b) || !(k in a) || JSON.stringify(b[k]) !== JSON.stringify(a[k]))
    .map((k) => (k in b && k in a ? `${k} ${show(b[k])} → ${show(a[k])}` : k in a ? `${k} ${show(a[k])}` : `${k} was ${show(b[k])}`))
    .join("; ");
}
