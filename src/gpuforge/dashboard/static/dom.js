// Building the pages: elements are made one by one and text goes in as text, never as HTML (job names,
// reasons and log lines come from users), and no style attribute is ever written (the CSP refuses them).

// el("a", {href: "/", class: "x", "data-id": 3, onclick: fn}, "text", child, ...): an element.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") node.addEventListener(name.slice(2), value);
    else if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name === "checked" || name === "value" || name === "disabled" || name === "selected") node[name] = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  node.append(...present(children));
  return node;
}

// Replace what `node` holds with `children`, less the null ones (the DOM's own replaceChildren would
// write a null out as the text "null").
export function fill(node, ...children) {
  node.replaceChildren(...present(children));
  return node;
}

const present = (children) => children.flat().filter((c) => c !== null && c !== undefined && c !== false).map(asNode);
const asNode = (c) => (c instanceof Node ? c : document.createTextNode(String(c)));

// Set an element's text only when it differs: a poll every 2 s must not reset a selection for nothing.
export function setText(node, text) {
  const t = String(text ?? "");
  if (node.textContent !== t) node.textContent = t;
}

// A state badge: coloured by the state (style.css .badge.state-<name>).
export function badge(state) {
  const s = String(state ?? "unknown");
  return el("span", { class: `badge state-${s.replace(/[^a-z_-]/gi, "")}`, text: s });
}

// A table with a header row; rows are appended to its tBody by the caller.
export function table(id, headings, attrs = {}) {
  return el(
    "table",
    { id, ...attrs },
    el("thead", {}, el("tr", {}, headings.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody"),
  );
}

// The error of an API answer as one line: `detail` is a text, or pydantic's list of {loc, msg}.
export function detailText(answer) {
  const detail = answer?.data?.detail;
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail
      .map((e) => {
        const loc = (e.loc || []).filter((part, i) => !(i === 0 && part === "body")).join(".");
        return loc ? `${loc}: ${e.msg}` : String(e.msg);
      })
      .join("; ");
  }
  if (detail !== undefined) return JSON.stringify(detail);
  return `HTTP ${answer?.status ?? "error"}`;
}

// The one line that says a page is not there (a job that does not exist or that the key may not see).
export function notFound(root) {
  root.replaceChildren(el("p", { id: "not-found", text: "not found" }));
}
