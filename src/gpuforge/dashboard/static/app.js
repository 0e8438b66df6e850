// The dashboard's entry: sign-in, the API wrapper, the router, the nav, polling and sign-out.
//
// The key lives in this tab's sessionStorage only and travels as `Authorization: Bearer` on every call,
// never in a URL or a cookie. Any 401 signs the tab out: a revoked key is signed out at its next poll.

import { detailText, el, notFound } from "/static/dom.js";

const KEY = "gpuforge.key";
const POLL_MS = 2000;

// Who is signed in: whoami's answer {name, admin, read_only, states}; null while signed out.
export let me = null;

// The states as the server defines them (whoami's `states`): no page keeps a list of its own.
export const jobStates = () => me?.states?.jobs ?? [];
export const jobEnded = (state) => (me?.states?.jobs_ended ?? []).includes(state);
export const deploymentEnded = (state) => (me?.states?.deployments_ended ?? []).includes(state);

// Thrown by api() on a 401 once the tab is signed out: it ends whatever was running (a poll, an action).
export class SignedOut extends Error {}

// One API call: {status, ok, data, headers}; data is the parsed JSON (null for an empty body).
// Statuses other than 401 are the caller's to read (404 → "not found", 422 → the detail, ...).
export async function api(path, { method = "GET", body, key } = {}) {
  const headers = { Accept: "application/json" };
  const k = key ?? sessionStorage.getItem(KEY);
  if (k) headers.Authorization = `Bearer ${k}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit", // the key is the only credential: no cookie ever goes along
    cache: "no-store",
  });
  let data = null;
  const text = await response.text();
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = { detail: text.slice(0, 500) }; // a proxy's HTML page, say: shown as a detail
    }
  }
  if (response.status === 401 && key === undefined && !me?.read_only) {
    signOut("key not accepted");
    throw new SignedOut("key not accepted");
  }
  return { status: response.status, ok: response.ok, data, headers: response.headers };
}

// A file from the API (a profile's trace), fetched with the key as api() sends it: the fetch Response.
export function fetchFile(path) {
  const k = sessionStorage.getItem(KEY);
  return fetch(path, { headers: k ? { Authorization: `Bearer ${k}` } : {}, credentials: "omit", cache: "no-store" });
}

// --- what the current page holds: its polls and charts, ended when the page is left ---
let leaving = [];

export function onLeave(fn) {
  leaving.push(fn);
}

function leavePage() {
  const fns = leaving;
  leaving = [];
  for (const fn of fns) {
    try {
      fn();
    } catch (err) {
      console.error(err);
    }
  }
}

// Run `fn` now and again POLL_MS after each run ends, while the page is visible (a hidden tab costs the
// server nothing; it catches up the moment it is shown again). `fn` returning false ends the polling.
// Returns {stop, now}: `now` runs it at once (after an action), or right after the run in progress.
export function poll(fn, every = POLL_MS) {
  let timer = null;
  let running = false;
  let again = false;
  let stopped = false;

  async function tick() {
    clearTimeout(timer);
    timer = null;
    if (stopped) return;
    if (running) {
      again = true;
      return;
    }
    if (document.visibilityState !== "visible") return; // onVisible starts it again
    running = true;
    try {
      if ((await fn()) === false) stopped = true;
      problem(null);
    } catch (err) {
      if (err instanceof SignedOut) stopped = true;
      else problem(err);
    } finally {
      running = false;
    }
    if (stopped) return;
    if (again) {
      again = false;
      tick();
    } else {
      timer = setTimeout(tick, every);
    }
  }

  function onVisible() {
    if (document.visibilityState === "visible" && timer === null && !running) tick();
  }

  function stop() {
    stopped = true;
    clearTimeout(timer);
    document.removeEventListener("visibilitychange", onVisible);
  }

  document.addEventListener("visibilitychange", onVisible);
  onLeave(stop);
  tick();
  return { stop, now: tick };
}

// A failed fetch (the server restarting, the network gone): one line under the header, cleared by the
// next poll that works.
export function problem(err) {
  const line = document.getElementById("problem");
  if (!line) return;
  if (err) console.error(err);
  line.textContent = err ? `cannot reach the server (${err.message || err}); retrying` : "";
  line.hidden = !err;
}

// --- pages ---
// path pattern → the module that draws it (loaded when first visited) and what it needs
const ROUTES = [
  { path: /^\/$/, module: "/static/jobs.js" },
  { path: /^\/jobs\/(\d+)\/?$/, module: "/static/job.js" },
  { path: /^\/compare\/?$/, module: "/static/compare.js" },
  { path: /^\/devices\/?$/, module: "/static/devices.js", full: true },
  { path: /^\/deployments\/?$/, module: "/static/deployments.js", full: true },
  { path: /^\/costs\/?$/, module: "/static/costs.js", full: true },
  { path: /^\/searches\/?$/, module: "/static/searches.js", full: true },
  { path: /^\/searches\/(\d+)\/?$/, module: "/static/searches.js", full: true },
  { path: /^\/audit\/?$/, module: "/static/audit.js", full: true },
];

const NAV = [
  { href: "/", text: "Jobs", match: /^\/(jobs\/|compare|$)/ },
  { href: "/devices", text: "Devices", full: true },
  { href: "/deployments", text: "Deployments", full: true },
  { href: "/costs", text: "Costs", full: true },
  { href: "/searches", text: "Searches", full: true },
  { href: "/audit", text: "Audit", full: true, audit: true }, // admins and maintainers read it
];

// Pages this tab may show: under `gpuforge dashboard` (read-only) only the jobs, a job, and compare.
function routeOf(pathname) {
  const path = pathname === "/index.html" || pathname === "/static/index.html" ? "/" : pathname;
  for (const r of ROUTES) {
    const m = path.match(r.path);
    if (m && !(r.full && me?.read_only)) return { ...r, id: m[1] };
  }
  return null;
}

let shown = 0; // counts page draws: an older draw still loading its module gives way to a newer one

async function route() {
  leavePage();
  problem(null);
  const root = document.getElementById("page");
  root.replaceChildren();
  markNav();
  const r = routeOf(location.pathname);
  if (!r) return notFound(root);
  const turn = ++shown;
  const page = await import(r.module);
  if (turn !== shown || !me) return;
  try {
    await page.render(root, { me, id: r.id, params: new URLSearchParams(location.search) });
  } catch (err) {
    if (!(err instanceof SignedOut)) problem(err);
  }
}

// Move within the app without loading the shell again (links to other things load as usual).
export function go(href) {
  history.pushState(null, "", href);
  route();
}

function onClick(event) {
  const a = event.target.closest?.("a[href]");
  if (!a || event.defaultPrevented || event.button !== 0) return;
  if (event.metaKey || event.ctrlKey || event.shiftKey || event.altKey || a.target || a.hasAttribute("download")) return;
  const url = new URL(a.href, location.href);
  if (url.origin !== location.origin || !routeOf(url.pathname)) return;
  event.preventDefault();
  go(url.pathname + url.search);
}

function markNav() {
  for (const a of document.querySelectorAll("#nav a")) {
    const item = NAV.find((n) => n.href === a.getAttribute("href"));
    const here = item.match ? item.match.test(location.pathname) : location.pathname.startsWith(item.href);
    if (here) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
}

function drawHeader() {
  const nav = document.getElementById("nav");
  const shown = (n) => !(n.full && me.read_only) && !(n.audit && !(me.admin || me.role === "maintainer"));
  nav.replaceChildren(...NAV.filter(shown).map((n) => el("a", { href: n.href, text: n.text })));
  const who = document.getElementById("whoami");
  const role = me.admin ? " (admin)" : me.role ? ` (${me.role}${me.project ? ` in ${me.project}` : ""})` : "";
  who.textContent = me.read_only ? `${me.name} · read-only` : me.name + role;
  document.getElementById("signout").hidden = !!me.read_only; // no key to forget
  markNav();
}

// --- signing in and out ---
function showApp(whoami) {
  me = whoami;
  document.body.classList.toggle("read-only", !!me.read_only);
  document.getElementById("signin-section").hidden = true;
  document.getElementById("session").hidden = false;
  drawHeader();
  route();
}

// Forget the key and show the sign-in form alone; `why` goes under it ("key not accepted").
export function signOut(why = "") {
  sessionStorage.removeItem(KEY);
  me = null;
  shown += 1; // a page still loading draws nothing
  leavePage();
  document.getElementById("page").replaceChildren();
  document.getElementById("session").hidden = true;
  document.getElementById("signin-section").hidden = false;
  document.getElementById("signin-error").textContent = why;
  const form = document.getElementById("signin");
  form.reset();
  form.elements.api_key.focus();
}

async function onSignIn(event) {
  event.preventDefault();
  const form = event.target;
  const key = form.elements.api_key.value.trim();
  const error = document.getElementById("signin-error");
  if (!key) return;
  const button = form.querySelector("button[type=submit]");
  button.disabled = true;
  error.textContent = "";
  try {
    const answer = await api("/api/v1/whoami", { key });
    if (answer.ok) {
      sessionStorage.setItem(KEY, key);
      form.reset();
      showApp(answer.data);
    } else if (answer.status === 401) {
      error.textContent = "key not accepted";
    } else {
      error.textContent = `the server answered ${answer.status}`;
    }
  } catch (err) {
    error.textContent = `cannot reach the server (${err.message})`;
  } finally {
    button.disabled = false;
  }
}

// Single sign-on, where the server offers it: a link to the issuer beside the key form, and, back from it,
// the one-time code in the URL's fragment traded for the session's key (server/sso.py), the fragment
// dropped from the address bar at once.
async function singleSignOn() {
  const code = new URLSearchParams(location.hash.slice(1)).get("sso");
  if (code) {
    history.replaceState(null, "", location.pathname + location.search);
    // the one request that sends a cookie: the HttpOnly one that ties the code to this browser
    const traded = await fetch("/auth/oidc/session", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "application/json" },
      body: JSON.stringify({ code }),
      credentials: "same-origin",
      cache: "no-store",
    });
    const data = await traded.json().catch(() => ({}));
    if (traded.ok) sessionStorage.setItem(KEY, data.key);
    else document.getElementById("signin-error").textContent = detailText({ status: traded.status, data });
  }
  const config = await api("/auth/oidc/config", { key: "" }).catch(() => null);
  if (config?.ok) {
    const link = document.getElementById("sso-start");
    link.textContent = `Sign in with ${new URL(config.data.issuer).host}`;
    link.href = `/auth/oidc/start?next=${encodeURIComponent(location.pathname + location.search)}`;
    document.getElementById("sso").hidden = false;
  }
}

// At load: a stored key is tried; with none, whoami may still answer (the read-only `gpuforge dashboard`).
async function start() {
  document.getElementById("signin").addEventListener("submit", onSignIn);
  document.getElementById("signout").addEventListener("click", () => signOut(""));
  document.addEventListener("click", onClick);
  window.addEventListener("popstate", () => me && route());
  await singleSignOn().catch(() => {});
  const stored = sessionStorage.getItem(KEY);
  let answer;
  try {
    answer = await api("/api/v1/whoami", { key: stored ?? "" });
  } catch (err) {
    signOut("");
    document.getElementById("signin-error").textContent = `cannot reach the server (${err.message})`;
    return;
  }
  if (answer.ok) showApp(answer.data);
  else signOut(stored ? "key not accepted" : "");
}

start();
