"""Screenshots of every page of the web dashboard, from a small demo: docs/dashboard/*.png, 1280x800.

    python scripts/dashboard_screenshots.py [--out docs/dashboard] [--keep]

Needs Chromium at /usr/bin/chromium (bash scripts/browser.sh) and the playwright package (the dev extra).
It starts a `gpuforge server` in a temporary home (loopback, SQLite, one CPU slot), makes a second key
(alice), and submits examples/digits-cnn.yaml, cut to 150 steps, four times:
  digits-cnn       lr 3e-3, by the admin: deployed once finished (`digits`) and asked a few questions
  digits-cnn       lr 1e-2, by alice: the pair the compare page shows
  digits-sweep     with compress.sweep: every compression variant, so its job page has a report
  digits-long      100,000 steps, by alice: cancelled once it trains
then saves, signed in with the admin key: jobs.png, job.png (the sweep's page), compare.png, devices.png,
deployments.png (with an answer in the try box), costs.png, and signin.png. About two minutes on a laptop.
`--keep` leaves the server's home (store, runs, server.log) in place and says where.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.client import Client  # noqa: E402
from gpuforge.server.local import LocalServer  # noqa: E402
from gpuforge.spec import load_spec  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
EXAMPLE = ROOT / "examples" / "digits-cnn.yaml"
VIEWPORT = {"width": 1280, "height": 800}
SHORT = [
    "train.epochs=null",
    "train.max_steps=150",
    "train.eval_every=50",
    "train.checkpoint_every=150",
    "compress.prune=null",
    "compress.quantize=null",
]


def wait_for(check, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        if time.monotonic() > deadline:
            raise SystemExit(f"dashboard_screenshots: {what}: not within {timeout_s:g} s")
        time.sleep(every_s)
    return found


def wait_ended(client: Client, job_id: int, want: str = "finished") -> dict:
    def ended():
        job = client.job(job_id)
        return job if job["state"] not in ("queued", "running") else None

    job = wait_for(ended, 600, f"job {job_id} to end")
    if job["state"] != want:
        raise SystemExit(f"dashboard_screenshots: job {job_id} ended {job['state']}: {job.get('reason')}")
    return job


def run_jobs(server: LocalServer) -> dict[str, int]:
    """The demo's jobs, ended as the pages should show them, and the deployment, ready and asked: the ids."""
    admin = server.client()
    alice = Client(server.url, admin.create_key("alice")["key"])
    ids = {
        "a": admin.submit(load_spec(EXAMPLE, [*SHORT, "train.lr=3e-3"]))["id"],
        "b": alice.submit(load_spec(EXAMPLE, [*SHORT, "train.lr=1e-2"]))["id"],
        "sweep": admin.submit(load_spec(EXAMPLE, [*SHORT, "name=digits-sweep", "compress.sweep=true"]))["id"],
    }
    long = load_spec(EXAMPLE, [*SHORT, "name=digits-long", "train.max_steps=100000"])
    ids["long"] = alice.submit(long)["id"]
    for which in ("a", "b", "sweep"):
        wait_ended(admin, ids[which])
        print(f"job {ids[which]} finished", flush=True)
    wait_for(lambda: (admin.job(ids["long"])["step"] or 0) >= 300, 300, "the long job's first steps")
    admin.cancel(ids["long"])
    wait_ended(admin, ids["long"], "cancelled")
    print(f"job {ids['long']} cancelled", flush=True)

    made = httpx.post(
        f"{server.url}/api/v1/deployments",
        json={"job_id": ids["a"], "name": "digits", "replicas": 1},
        headers={"Authorization": f"Bearer {server.key}"},
        timeout=60,
    )
    if made.status_code != 201:
        raise SystemExit(f"dashboard_screenshots: deploy: {made.status_code} {made.text}")
    wait_for(lambda: admin.deployment("digits")["state"] != "starting", 300, "the deployment to start")
    if (state := admin.deployment("digits")["state"]) != "ready":
        raise SystemExit(f"dashboard_screenshots: the deployment is {state}")
    images = digit_images(8)
    for i in range(40):  # some traffic for its requests/s and latencies
        admin.predict("digits", [images[i % len(images)]])
    print("deployment digits ready", flush=True)
    return ids


def digit_images(n: int) -> list[list[list[float]]]:
    """The first `n` of scikit-learn's digits, 8x8, scaled to 0..1 as sklearn:digits trains on them."""
    from sklearn.datasets import load_digits

    return [(image / 16.0).round(3).tolist() for image in load_digits().images[:n]]


# each piece of text on the page, less what is quoted as it is (the spec's YAML says `null`, a log may)
TEXTS = """() => { const texts = [], walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walk.nextNode(); node; node = walk.nextNode()) {
    if (node.parentElement.closest('pre, textarea, script, style')) continue;
    if (node.nodeValue.trim()) texts.push(node.nodeValue.trim());
  }
  return texts; }"""
STRAY = re.compile(r"\b(null|undefined|NaN)\b|\[object Object\]")


def shoot(page, out: Path, name: str, *ready: str) -> None:
    """Wait for each `ready` selector, let the charts draw, save out/name.png (the viewport, 1280x800).
    Says so when the page shows a stray null, undefined or NaN (a bug a screenshot would keep)."""
    for selector in ready:
        page.locator(selector).first.wait_for(state="visible", timeout=30_000)
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(500)
    page.screenshot(path=str(out / f"{name}.png"))
    print(f"{out / name}.png", flush=True)
    if stray := [text for text in page.evaluate(TEXTS) if STRAY.search(text)]:
        print(f"  WARNING: {page.url} shows {stray[:5]}", flush=True)


def screenshots(server: LocalServer, ids: dict[str, int], out: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = browser.new_context(viewport=VIEWPORT).new_page()
        page.on("pageerror", lambda e: print(f"  WARNING: {page.url}: script error: {e}", flush=True))
        page.goto(server.url + "/")
        shoot(page, out, "signin", "form#signin")

        page.locator("form#signin input[name=api_key]").fill(server.key)
        page.locator("form#signin [type=submit]").click()
        page.locator("table#jobs tr[data-job-id]").nth(len(ids) - 1).wait_for(timeout=30_000)
        shoot(page, out, "jobs", "table#jobs", "#whoami")

        page.goto(f"{server.url}/jobs/{ids['sweep']}")
        shoot(page, out, "job", ".chart[data-metric=loss][data-points]", "#summary", "#report")

        page.goto(f"{server.url}/compare?ids={ids['a']},{ids['b']}")
        shoot(page, out, "compare", '.chart[data-metric=loss][data-runs="2"]', "table#spec-diff")

        page.goto(f"{server.url}/devices")
        shoot(page, out, "devices", "table#devices tr[data-device-id]")

        page.goto(f"{server.url}/deployments")
        page.locator("table#deployments tr[data-deployment]").first.wait_for(timeout=30_000)
        page.locator("textarea[name=input]").fill(json.dumps(digit_images(2)))
        page.locator("button[data-action=predict]").click()
        page.wait_for_function(
            "() => (document.querySelector('pre#predict-answer')?.textContent || '').includes('label')",
            timeout=30_000,
        )
        shoot(page, out, "deployments", "pre#predict-answer")

        page.goto(f"{server.url}/costs")
        shoot(page, out, "costs", "table#costs")
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard")
    parser.add_argument("--keep", action="store_true", help="keep the server's home (store, runs, log)")
    args = parser.parse_args()
    if not CHROMIUM.exists():
        raise SystemExit(f"dashboard_screenshots: no {CHROMIUM} (bash scripts/browser.sh installs it)")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpuforge-screenshots-"))
    server = LocalServer(tmp / "home", log=tmp / "server.log", GPUFORGE_ALLOW_USER_CODE="true")
    try:
        with server:
            print(f"server {server.url} (home {tmp / 'home'}, log {tmp / 'server.log'})", flush=True)
            ids = run_jobs(server)
            try:
                screenshots(server, ids, args.out)
            finally:
                server.client().undeploy("digits")  # its replica runs in a session of its own
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
