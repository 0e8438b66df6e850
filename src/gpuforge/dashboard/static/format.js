// How figures read on the pages: each returns a string, "—" for a figure that is not known (null).

const NONE = "—";
const known = (x) => x !== null && x !== undefined && Number.isFinite(Number(x));

// Plain counts: 12,345 (thousands grouped); fractions to 1 decimal under 100.
export function num(x) {
  if (!known(x)) return NONE;
  const n = Number(x);
  const digits = Number.isInteger(n) || Math.abs(n) >= 100 ? 0 : 1;
  return n.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

// A job's progress: "37/400", or "37" where it declared no total (a script job may not).
export function steps(step, total) {
  if (step == null && total == null) return NONE;
  return total == null ? `${step}` : `${step ?? 0}/${total}`;
}

// A loss or metric: 4 significant digits, exponent form when far from 1.
export function sig4(x) {
  if (!known(x)) return NONE;
  const n = Number(x);
  if (n !== 0 && (Math.abs(n) >= 1e5 || Math.abs(n) < 1e-3)) return n.toExponential(3);
  return n.toPrecision(4);
}

// Dollars: 4 decimals under $1 (a short run costs fractions of a cent), else cents.
export function dollars(x) {
  if (!known(x)) return NONE;
  const n = Number(x);
  const digits = Math.abs(n) < 1 ? 4 : 2;
  return "$" + n.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}

// A fraction (MFU 0.447) as a percentage: 44.7%; a small one keeps 2 significant digits (0.042%).
export function pct(x) {
  if (!known(x)) return NONE;
  const v = Number(x) * 100;
  if (v !== 0 && Math.abs(v) < 1) return v.toPrecision(2) + "%";
  return v.toFixed(1) + "%";
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

// Bytes in binary units: 1.5 GiB.
export function bytes(x) {
  if (!known(x)) return NONE;
  let n = Number(x);
  let i = 0;
  while (Math.abs(n) >= 1024 && i < UNITS.length - 1) {
    n /= 1024;
    i += 1;
  }
  const digits = i === 0 || Math.abs(n) >= 100 ? 0 : 1;
  return `${n.toFixed(digits)} ${UNITS[i]}`;
}

// Seconds as 1h02m, 3m05s, 42s (an ETA or a wall time).
export function duration(seconds) {
  if (!known(seconds)) return NONE;
  const s = Math.max(0, Math.round(Number(seconds)));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const pad = (v) => String(v).padStart(2, "0");
  if (h >= 24) return `${Math.floor(h / 24)}d${pad(h % 24)}h`;
  if (h > 0) return `${h}h${pad(m)}m`;
  if (m > 0) return `${m}m${pad(s % 60)}s`;
  return `${s}s`;
}

// A time stamp (Unix seconds or an ISO text) in local time: the time alone when it is today.
export function when(ts) {
  if (ts === null || ts === undefined || ts === "") return NONE;
  const d = typeof ts === "number" ? new Date(ts * 1000) : new Date(ts);
  if (Number.isNaN(d.getTime())) return String(ts);
  const time = d.toLocaleTimeString("en-GB", { hour12: false });
  const today = new Date().toDateString() === d.toDateString();
  return today ? time : `${d.toISOString().slice(0, 10)} ${time}`;
}

// Any value of a summary or a spec, by what its key says it is.
export function byKey(key, value) {
  if (value === null || value === undefined) return NONE;
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (typeof value !== "number") return typeof value === "string" ? value : JSON.stringify(value);
  if (/(^|_)bytes($|[._])|_mem/.test(key)) return bytes(value); // process_state_bytes.params too
  if (/usd/.test(key)) return dollars(value);
  if (/(^|\.)mfu$|_frac$/.test(key)) return pct(value);
  if (/(^|_)s$/.test(key) && !/per_s$/.test(key)) return value >= 60 ? duration(value) : `${sig4(value)} s`;
  return Number.isInteger(value) ? num(value) : sig4(value);
}

// The decimals a tick increment needs (uPlot's increments are 1, 2, 2.5 or 5 times a power of 10).
function decimals(incr) {
  let d = 0;
  while (d < 12 && Math.abs(incr * 10 ** d - Math.round(incr * 10 ** d)) > 1e-6) d += 1;
  return d;
}

// The y-axis ticks of a metric's chart, in the metric's own unit, with as many decimals as the ticks'
// spacing needs (a narrow range, 399.2 to 399.8 MiB, must not read 399 MiB four times).
// uPlot calls it as axes[].values(u, splits, axisIdx, space, incr).
export function ticks(metric) {
  const fixed = (v, incr, scale = 1) => (v * scale).toFixed(Math.min(decimals(incr * scale), 10));
  if (metric === "mfu") return (u, splits, ax, space, incr) => splits.map((v) => `${fixed(v, incr, 100)}%`);
  if (metric.includes("usd")) return (u, splits, ax, space, incr) => splits.map((v) => `$${fixed(v, incr)}`);
  if (metric.endsWith("_bytes")) {
    return (u, splits, ax, space, incr) => {
      const top = Math.max(...splits.map(Math.abs));
      let i = 0;
      while (top >= 1024 ** (i + 1) && i < UNITS.length - 1) i += 1;
      const d = Math.min(decimals(incr / 1024 ** i), 2);
      return splits.map((v) => `${(v / 1024 ** i).toFixed(d)} ${UNITS[i]}`);
    };
  }
  return (u, splits, ax, space, incr) =>
    splits.map((v) => (Math.abs(v) >= 1000 && decimals(incr) === 0 ? num(v) : fixed(v, incr)));
}

// a job's devices: those it holds ("cpu:0", "cuda:0 (0.5 of it)"), else what it asks for
export function devices(j) {
  const share = j.device_share != null ? j.device_share : null;
  if (j.devices) return share != null ? `${j.devices} (${share} of it)` : j.devices;
  if (share != null) return `${share} of a ${j.device_type}`;
  return j.devices_wanted ? `${j.devices_wanted} × ${j.device_type}` : "—";
}
