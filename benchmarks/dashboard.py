"""The web dashboard in a real browser: the jobs page over 1,000 jobs, and the bytes of a long run's page.

    python benchmarks/dashboard.py [--jobs 1000] [--rounds 5] [--records 100000] [--json out.json]

Chromium (headless, /usr/bin/chromium: bash scripts/browser.sh) through Playwright, against real
`gpuforge server` processes on loopback (temporary GPUFORGE_HOMEs, SQLite), on this machine's cores.

(a) The jobs page with `--jobs` jobs in the store: a server with scheduling off (the jobs stay queued),
    `--jobs` submits of examples/digits-cnn.yaml through the API (4 threads). Signed in once with the
    admin key; then `--rounds` loads of `/` in that tab (a reload: the key stays in sessionStorage, the
    static files are revalidated). Per load, from the navigation's start, by the page's clock: first paint
    and first contentful paint (performance.getEntriesByType('paint')), DOMContentLoaded, the first
    `tr[data-job-id]` row and the first page of rows (50) present (a MutationObserver set before the
    page's scripts run), and the GET /api/v1/jobs request's own duration (Resource Timing).
(b) The bytes a job's page downloads for a long run: a server that runs jobs gets two short real runs of
    the digits CNN (20 steps, a metrics record a step, eval every 10); once they finish, the benchmark
    replaces each run's metrics.jsonl with SYNTHETIC records, 1,000 and `--records` of them, written with
    the runner's own layout (the keys of the real run's records, eval keys every 1,000th step; made-up
    values: a decaying loss, noisy speeds). Then each job's page is loaded in a fresh signed-in tab and
    every response it gets until its loss chart is drawn and the network is quiet (500 ms) is summed:
    the bodies (Playwright's response.body()) and the bytes on the wire (Resource Timing transferSize).
    Beside it: the whole series of the same run without downsampling (gpuforge.run_files.series with no
    limit, as compact JSON: what the page would get without the server's min/max buckets), and
    metrics.jsonl's size.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.run_files import series  # noqa: E402
from gpuforge.server.local import LocalServer  # noqa: E402
from gpuforge.spec import load_spec  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
SPEC = ROOT / "examples" / "digits-cnn.yaml"
PAGE_ROWS = 50  # the jobs page shows pages of 50
EVAL_EVERY = 1000  # synthetic eval records: every 1,000th step
SHORT = [
    "train.epochs=null",
    "train.max_steps=20",
    "train.log_every=1",
    "train.eval_every=10",
    "train.checkpoint_every=20",
    "compress.prune=null",
    "compress.quantize=null",
]
WATCH_ROWS = """
window.__bench = {};
new MutationObserver(() => {
  const rows = document.querySelectorAll('table#jobs tr[data-job-id]').length;
  if (rows && !window.__bench.first_row) window.__bench.first_row = performance.now();
  if (rows >= WANT && !window.__bench.filled) window.__bench.filled = performance.now();
}).observe(document, { childList: true, subtree: true });
"""
TIMES = """() => {
  const paint = Object.fromEntries(performance.getEntriesByType('paint').map((e) => [e.name, e.startTime]));
  const nav = performance.getEntriesByType('navigation')[0];
  const jobs = performance.getEntriesByType('resource').filter((e) => /\\/api\\/v1\\/jobs\\?/.test(e.name));
  return {
    first_paint: paint['first-paint'], first_contentful_paint: paint['first-contentful-paint'],
    dom_content_loaded: nav.domContentLoadedEventEnd, first_row: window.__bench.first_row,
    filled: window.__bench.filled, api_jobs: jobs.length ? jobs[0].duration : null,
    count: (document.querySelector('#jobs-count') || {}).textContent || '',
  };
}"""
WIRE = """() => [...performance.getEntriesByType('navigation'), ...performance.getEntriesByType('resource')]
  .map((e) => ({ name: e.name, transfer: e.transferSize, encoded: e.encodedBodySize }))"""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_for(check, timeout_s: float, what: str, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            raise SystemExit(f"benchmarks/dashboard.py: {what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return found


def sign_in(page, url: str, key: str) -> None:
    page.goto(url + "/")
    page.locator("form#signin input[name=api_key]").fill(key)
    page.locator("form#signin [type=submit]").click()
    page.locator("#whoami").wait_for(state="visible")


# --- (a) the jobs page over many jobs --------------------------------------------------------------
def submit_many(url: str, key: str, n: int, threads: int = 4) -> float:
    body = {"spec": load_spec(SPEC, SHORT).to_yaml()}

    def some(count: int) -> None:
        with httpx.Client(base_url=url, headers=auth(key), timeout=60) as client:
            for _ in range(count):
                client.post("/api/v1/jobs", json=body).raise_for_status()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        shares = [n // threads + (i < n % threads) for i in range(threads)]
        list(pool.map(some, shares))
    return time.perf_counter() - start


def jobs_page(browser, n_jobs: int, rounds: int, tmp: Path) -> dict:
    with LocalServer(tmp / "a-home", log=tmp / "a-server.log", GPUFORGE_SCHEDULE="false",
                     GPUFORGE_DATA_ROOTS=str(ROOT / "examples")) as server:  # fmt: skip
        submit_s = submit_many(server.url, server.key, n_jobs)
        listed = httpx.get(f"{server.url}/api/v1/jobs?limit=1", headers=auth(server.key))
        total = listed.headers.get("x-total-count", "?")
        print(f"(a) {total} jobs in the store ({submit_s:.1f} s to submit them, 4 threads)", flush=True)
        page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
        page.add_init_script(WATCH_ROWS.replace("WANT", str(min(PAGE_ROWS, n_jobs))))
        sign_in(page, server.url, server.key)
        page.wait_for_function("() => window.__bench.filled", timeout=60_000)
        loads = []
        for _ in range(rounds):
            page.reload()
            page.wait_for_function("() => window.__bench.filled", timeout=60_000)
            loads.append(page.evaluate(TIMES))
        page.context.close()
    return {"jobs": n_jobs, "submit_s": submit_s, "loads": loads}


def print_jobs_page(result: dict) -> None:
    loads = result["loads"]
    print(f"\n(a) the jobs page, {result['jobs']} jobs in the store: ms from the navigation's start, "
          f"{len(loads)} reloads of a signed-in tab")  # fmt: skip
    rows = [
        ("first paint", "first_paint"),
        ("first contentful paint", "first_contentful_paint"),
        ("DOMContentLoaded", "dom_content_loaded"),
        ("first job row", "first_row"),
        (f"first {PAGE_ROWS} rows (table filled)", "filled"),
        ("GET /api/v1/jobs itself", "api_jobs"),
    ]
    heads = "".join(f"{f'load {i + 1}':>9}" for i in range(len(loads)))
    print(f"{'':<30}{heads}{'median':>9}")
    for label, key in rows:
        values = [load[key] for load in loads]
        if any(v is None for v in values):
            print(f"{label:<30}{'(not reported by the browser)':>9}")
            continue
        cells = "".join(f"{v:>9.0f}" for v in values)
        print(f"{label:<30}{cells}{statistics.median(values):>9.0f}")
    print(f"#jobs-count said: {loads[-1]['count'].strip()!r}")


# --- (b) the bytes of a long run's page ------------------------------------------------------------
def synthetic_records(real: list[dict], n: int, seed: int = 0) -> list[dict]:
    """`n` records with the keys of the real run's records (eval keys every EVAL_EVERY-th step); the
    values are made up around the real ones: a decaying loss, noisy speeds, cost adding up, ETA falling."""
    rng = random.Random(seed)
    train = next(r for r in real if not any(k.startswith("eval_") for k in r))
    with_eval = next((r for r in real if any(k.startswith("eval_") for k in r)), None)
    step_cost = train.get("step_cost_usd") or 1e-6
    out = []
    for step in range(1, n + 1):
        layout = with_eval if with_eval is not None and step % EVAL_EVERY == 0 else train
        record = {}
        for key, value in layout.items():
            if key == "step":
                record[key] = step
            elif value is None or not isinstance(value, (int, float)):
                record[key] = value
            elif key in ("loss", "eval_loss"):
                record[key] = 2.3 * math.exp(-step / (n / 5)) + 0.05 + abs(rng.gauss(0, 0.05))
            elif key == "eval_accuracy":
                record[key] = min(1.0, 0.99 - 0.9 * math.exp(-step / (n / 5)) + rng.gauss(0, 0.003))
            elif key == "lr":
                record[key] = value * 0.5 * (1 + math.cos(math.pi * step / n))
            elif key == "cost_usd":
                record[key] = step * step_cost
            elif key == "eta_s":
                record[key] = (n - step) * (train.get("step_time_s") or 0.01)
            elif isinstance(value, int):
                record[key] = value + rng.randrange(0, 4096)
            else:
                record[key] = value * (1 + rng.gauss(0, 0.05))
        out.append(record)
    return out


def write_metrics(path: Path, records: list[dict]) -> None:
    """As the runner appends them: one json.dumps a line. Atomic, so the server never reads half."""
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def page_bytes(browser, url: str, key: str, job_id: int) -> dict:
    """Every response the job's page gets until its loss chart is drawn and the network is quiet."""
    page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    sign_in(page, url, key)
    seen = []

    def on_response(response) -> None:
        seen.append(response)

    page.on("response", on_response)
    page.goto(f"{url}/jobs/{job_id}")
    page.wait_for_function(
        "() => Number(document.querySelector('.chart[data-metric=loss]')?.dataset.points || 0) > 0",
        timeout=60_000,
    )
    page.wait_for_load_state("networkidle")
    points = int(page.locator(".chart[data-metric=loss]").first.get_attribute("data-points"))
    wire = page.evaluate(WIRE)
    page.remove_listener("response", on_response)
    responses = []
    for response in seen:
        try:
            size = len(response.body())
        except Exception:  # a redirect or a body the browser let go: counted as nothing
            size = 0
        responses.append((response.url.removeprefix(url), size))
    page.context.close()
    return {
        "points": points,
        "responses": responses,
        "body_bytes": sum(s for _, s in responses),
        "api_bytes": sum(s for u, s in responses if u.startswith("/api/")),
        "series_bytes": sum(s for u, s in responses if "/series" in u),
        "transfer_bytes": sum(w["transfer"] for w in wire),
    }


def long_run_page(browser, sizes: list[int], tmp: Path) -> list[dict]:
    roots = str(ROOT / "examples")
    with LocalServer(tmp / "b-home", log=tmp / "b-server.log", GPUFORGE_DATA_ROOTS=roots) as server:
        headers = auth(server.key)
        body = {"spec": load_spec(SPEC, SHORT).to_yaml()}
        ids = []
        for _ in sizes:
            created = httpx.post(f"{server.url}/api/v1/jobs", json=body, headers=headers, timeout=60)
            created.raise_for_status()
            ids.append(created.json()["id"])

        def finished(job_id):
            job = httpx.get(f"{server.url}/api/v1/jobs/{job_id}", headers=headers).json()
            if job["state"] not in ("queued", "running", "finished"):
                raise SystemExit(f"benchmarks/dashboard.py: job {job_id} {job['state']}: {job['reason']}")
            return job if job["state"] == "finished" else None

        results = []
        for job_id, n in zip(ids, sizes, strict=True):
            job = wait_for(lambda job_id=job_id: finished(job_id), 300, f"job {job_id} to finish")
            metrics = Path(job["run_dir"]) / "metrics.jsonl"
            real = [json.loads(line) for line in metrics.read_text().splitlines()]
            write_metrics(metrics, synthetic_records(real, n))
            full = json.dumps(series(metrics, max_points=10 * n), separators=(",", ":"))
            measured = page_bytes(browser, server.url, server.key, job_id)
            keys = list(dict.fromkeys(k for r in real for k in r))
            results.append({"job": job_id, "records": n, "keys": keys, "real_steps": len(real),
                            "metrics_bytes": metrics.stat().st_size, "full_series_bytes": len(full),
                            **measured})  # fmt: skip
    return results


def print_long_runs(results: list[dict]) -> None:
    first, last = results[0], results[-1]
    print("\n(b) a job page's downloads, until its loss chart is drawn and the network is quiet (bytes)")
    print(f"    SYNTHETIC metrics: each job is a real {first['real_steps']}-step digits run whose")
    print("    metrics.jsonl the benchmark replaced with made-up records in the runner's layout; their keys:")
    print(f"    {', '.join(first['keys'])} (eval_* every {EVAL_EVERY:,}th step)")
    rows = [
        ("metrics.jsonl", lambda r: r["metrics_bytes"]),
        ("its series, not downsampled", lambda r: r["full_series_bytes"]),
        ("the page: every response body", lambda r: r["body_bytes"]),
        ("  of which /api/v1", lambda r: r["api_bytes"]),
        ("  of which the series", lambda r: r["series_bytes"]),
        ("the page on the wire", lambda r: r["transfer_bytes"]),
        ("points in the loss chart", lambda r: r["points"]),
    ]
    heads = "".join(f"{format(r['records'], ',') + ' records':>18}" for r in results)
    print(f"{'':<32}{heads}")
    for label, figure in rows:
        print(f"{label:<32}{''.join(f'{figure(r):>18,}' for r in results)}")
    ratios = "".join(
        f"{r['full_series_bytes'] / r['series_bytes'] if r['series_bytes'] else float('nan'):>17.1f}x"
        for r in results
    )
    print(f"{'not downsampled / the series':<32}{ratios}")
    if len(results) > 1 and first["body_bytes"]:
        grew = last["body_bytes"] / first["body_bytes"]
        print(f"the page, {last['records']:,} records against {first['records']:,}: {grew:.2f}x the bytes")
    print(f"the {last['records']:,}-record page's responses, largest first (body bytes):")
    for path, size in sorted(last["responses"], key=lambda r: -r[1])[:12]:
        print(f"  {size:>10,}  {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    if not CHROMIUM.exists():
        raise SystemExit(f"benchmarks/dashboard.py: no {CHROMIUM} (bash scripts/browser.sh installs it)")
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="gpuforge-dashboard-") as tmp, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        print(f"Chromium {browser.version}, headless, on this machine ({os.cpu_count()} cores, shared with "
              "the server)", flush=True)  # fmt: skip
        jobs = jobs_page(browser, args.jobs, args.rounds, Path(tmp))
        print_jobs_page(jobs)
        runs = long_run_page(browser, [1000, args.records], Path(tmp))
        print_long_runs(runs)
        browser.close()
    if args.json:
        for run in runs:
            run.pop("responses")
        args.json.write_text(json.dumps({"jobs_page": jobs, "long_runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
