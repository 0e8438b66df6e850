"""The dashboard as a person uses it: Chromium, headless, against a real `gpuforge server` on loopback that
runs real (tiny) jobs, and against `gpuforge dashboard RUNS_DIR` over a real run directory. Elements are
found by the names docs/dashboard.md gives them. A failed test leaves failure.png in its tmp_path."""

from __future__ import annotations

import gzip
import json
import re
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from playwright.sync_api import expect

from gpuforge.spec import load_spec
from tests.helpers.browser import (
    NOT_ACCEPTED,
    POLL_S,
    cancel,
    job,
    job_ids,
    make_key,
    points,
    revoke_key,
    sign_in,
    start_local_dashboard,
    stop,
    submit,
    submit_form,
    text_of,
    wait_for,
    wait_state,
)
from tests.helpers.cli import run_cli
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow

NAME = "digits-dash"
LRS = (1e-2, 3e-2)  # the pair compared: the same spec but for train.lr


def _spec(tmp_path, name: str = NAME, **train) -> dict:
    spec = image_spec(tmp_path, **{"max_steps": 12, **train})
    spec["name"] = name
    spec["cost"] = {"usd_per_hour": 0.5}  # something for the costs page to show
    return spec


@pytest.fixture(scope="module")
def pair(dashboard_server, tmp_path_factory) -> tuple[int, int]:
    """Two short runs, submitted when the module starts (they train while the first tests run): their ids."""
    where = tmp_path_factory.mktemp("pair")
    server = dashboard_server
    profile = {"start_step": 4, "steps": 2}  # both: the profile section on every job page the tests read
    return tuple(submit(server.url, server.key, _spec(where, lr=lr, profile=profile))["id"] for lr in LRS)


def _finished_pair(server, pair) -> tuple[int, int]:
    for job_id in pair:
        wait_state(server.url, server.key, job_id)
    return pair


def _row(page, job_id: int):
    return page.locator(f"table#jobs tr[data-job-id='{job_id}']")


def test_a_wrong_key_is_not_accepted_and_the_right_one_shows_the_jobs(page, dashboard_server, pair):
    server = dashboard_server
    sign_in(page, server.url, "gf_" + "x" * 40, wait=False)
    expect(page.locator("#signin-error")).to_have_text(NOT_ACCEPTED)
    expect(page.locator("form#signin")).to_be_visible()
    assert page.locator("tr[data-job-id]").count() == 0

    sign_in(page, server.url, server.key)
    expect(page.locator("table#jobs")).to_be_visible()
    for job_id in pair:
        expect(_row(page, job_id)).to_be_visible()
    expect(page.locator("form#signin")).to_be_hidden()


def test_a_job_submitted_through_the_api_appears_and_its_state_changes_without_a_reload(
    page, dashboard_server, pair, tmp_path
):
    server = dashboard_server
    sign_in(page, server.url, server.key)
    page.evaluate("window.__notReloaded = true")
    job_id = submit(server.url, server.key, _spec(tmp_path, name="digits-live", max_steps=6))["id"]
    state = _row(page, job_id).locator("td[data-field=state]")
    expect(state).to_have_text(re.compile(r"queued|running"), timeout=3 * POLL_S * 1000)  # behind the pair
    expect(state).to_have_text(re.compile(r"\bfinished\b"), timeout=120_000)
    assert page.evaluate("window.__notReloaded === true"), "the page was reloaded"
    assert job(server.url, server.key, job_id)["state"] == "finished"


def test_the_loss_chart_grows_while_a_job_trains(page, dashboard_server, pair, tmp_path):
    server = dashboard_server
    # ~0.03 s a step (the test model sleeps), a point a step: 300 steps train for about 10 s
    long = _spec(tmp_path, name="digits-long", max_steps=300, log_every=1, options={"sleep_s": 0.03})
    job_id = submit(server.url, server.key, long)["id"]
    wait_state(server.url, server.key, job_id, ("running",))
    wait_for(lambda: (job(server.url, server.key, job_id)["step"] or 0) >= 5, 60, what="its first steps")
    sign_in(page, server.url, server.key, path=f"/jobs/{job_id}")
    first = wait_for(lambda: points(page), 15, what="a loss chart with points")
    wait_for(lambda: points(page) > first, 4 * POLL_S, what=f"more than {first} points, without a reload")
    # a person sees a line, not a number: the chart has something drawn in it
    expect(page.locator(".chart[data-metric=loss]").locator("canvas, svg").first).to_be_visible()


def test_a_profiled_job_shows_its_mean_step_as_a_stacked_bar_and_saves_its_trace(
    page, dashboard_server, pair
):
    server = dashboard_server
    a, _ = _finished_pair(server, pair)
    sign_in(page, server.url, server.key, path=f"/jobs/{a}")
    expect(page.locator("#profile-title")).to_contain_text("over 2 steps from step 4")
    rects = page.locator("#profile figure.stack rect")
    parts = rects.evaluate_all("rs => rs.map(r => [r.getAttribute('data-part'), +r.getAttribute('width')])")
    assert "forward" in dict(parts) and abs(sum(w for _, w in parts) - 1000) < 15, parts  # the whole step
    expect(page.locator("#profile .legend li[data-part=forward]")).to_be_visible()
    assert (
        page.locator("#profile-advice li").count() >= 1
        and page.locator("#profile-operators tbody tr").count()
    )
    with page.expect_download() as saving:
        page.locator("#profile-trace").click()
    download = saving.value
    assert download.suggested_filename == f"job-{a}-trace.json.gz"
    trace = json.loads(gzip.decompress(Path(download.path()).read_bytes()))
    assert any(e.get("name") == "gpuforge.step" for e in trace["traceEvents"])  # what the run recorded


def test_compare_overlays_two_runs_and_lists_only_the_keys_that_differ(page, dashboard_server, pair):
    server = dashboard_server
    a, b = _finished_pair(server, pair)
    sign_in(page, server.url, server.key, path=f"/compare?ids={a},{b}")
    expect(page.locator('.chart[data-metric=loss][data-runs="2"]')).to_be_visible()
    diff = page.locator("table#spec-diff")
    expect(diff).to_be_visible()
    expect(diff).to_contain_text("train.lr")
    keys = [text_of(row, "td, th") for row in diff.locator("tr").all()]
    assert "train.lr" in keys, keys
    for same in ("name", "train.max_steps", "train.batch_size", "model.source", "data.train"):
        assert same not in keys, f"{same} is the same in both runs, yet listed: {keys}"
    expect(page.locator("table#finals")).to_be_visible()


def test_the_job_page_shows_its_timeline_log_spec_and_summary(page, dashboard_server, pair):
    server = dashboard_server
    job_id = _finished_pair(server, pair)[0]
    sign_in(page, server.url, server.key, path=f"/jobs/{job_id}")
    expect(page.locator("#job-title")).to_contain_text(re.compile(rf"{NAME}|\b{job_id}\b"))
    expect(page.locator("#timeline li[data-event=started]")).to_have_count(1)
    expect(page.locator("#timeline li[data-event=finished]")).to_have_count(1)
    expect(page.locator("pre#log")).to_contain_text("finished at step 12/12")
    expect(page.locator("pre#spec")).to_contain_text(f"name: {NAME}")
    expect(page.locator("#summary")).to_be_visible()
    expect(page.locator("#summary")).not_to_have_text("")
    assert points(page) == 12  # a point a step, none downsampled away


def test_a_bad_spec_in_the_submit_form_shows_its_error_and_queues_nothing(page, dashboard_server, tmp_path):
    server = dashboard_server
    sign_in(page, server.url, server.key)
    before = job_ids(server.url, server.key)
    bad = write_spec(tmp_path / "bad.yaml", _spec(tmp_path, lr=-1)).read_text()
    page.locator("form#submit textarea[name=spec]").fill(bad)
    submit_form(page, "form#submit")
    error = page.locator("#spec-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("train.lr")
    time.sleep(POLL_S)  # a job queued anyway would be listed by now
    assert job_ids(server.url, server.key) == before
    assert page.locator("table#jobs tr[data-job-id]").count() == len(before)


def test_a_user_key_sees_only_its_own_jobs(page, dashboard_server, tmp_path):
    server = dashboard_server
    alice, bob = (make_key(server.url, server.key, name) for name in ("alice", "bob"))
    hers = submit(server.url, alice, _spec(tmp_path, name="alice-run"))["id"]
    his = submit(server.url, bob, _spec(tmp_path, name="bob-run"))["id"]
    for job_id in (hers, his):  # listed all the same; nothing to train
        cancel(server.url, server.key, job_id)
    sign_in(page, server.url, alice)
    expect(page.locator("#whoami")).to_contain_text("alice")
    expect(_row(page, hers)).to_be_visible()
    assert page.locator(f"tr[data-job-id='{his}']").count() == 0
    assert [int(r.get_attribute("data-job-id")) for r in page.locator("tr[data-job-id]").all()] == [hers]

    page.goto(f"{server.url}/jobs/{his}")
    expect(page.locator("#not-found")).to_be_visible()
    assert "bob-run" not in page.locator("body").inner_text()


def test_revoking_the_key_signs_the_tab_out_at_its_next_poll(page, dashboard_server):
    server = dashboard_server
    carol = make_key(server.url, server.key, "carol")
    sign_in(page, server.url, carol)
    expect(page.locator("table#jobs")).to_be_visible()
    revoke_key(server.url, server.key, "carol")
    expect(page.locator("form#signin")).to_be_visible(timeout=3 * POLL_S * 1000)
    expect(page.locator("#signin-error")).to_have_text(NOT_ACCEPTED)
    assert page.evaluate("Object.values(sessionStorage).join(' ')").find(carol) == -1, "the key stayed"


STRAY = re.compile(r"\b(null|undefined|NaN)\b|\[object Object\]")
# each piece of text on the page, less what is quoted as it is (the spec's YAML says `null`, a log may)
TEXTS = """() => { const texts = [], walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walk.nextNode(); node; node = walk.nextNode()) {
    if (node.parentElement.closest('pre, textarea, script, style')) continue;
    if (node.nodeValue.trim()) texts.push(node.nodeValue.trim());
  }
  return texts; }"""


def test_every_page_draws_without_a_script_error_or_a_stray_null(page, dashboard_server, pair):
    server = dashboard_server
    a, b = _finished_pair(server, pair)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    sign_in(page, server.url, server.key)
    pages = {
        "/": "table#jobs tr[data-job-id]",
        f"/jobs/{a}": ".chart[data-metric=loss]",
        f"/compare?ids={a},{b}": "table#spec-diff",
        "/devices": "table#devices tr[data-device-id]",
        "/deployments": "table#deployments",
        "/costs": "table#costs",
    }
    for path, ready in pages.items():
        page.goto(server.url + path)
        expect(page.locator(ready).first).to_be_visible()
        for link in ("/", "/devices", "/deployments", "/costs"):
            expect(page.locator(f"nav a[href='{link}']")).to_have_count(1)
        page.wait_for_load_state("networkidle")
        stray = [text for text in page.evaluate(TEXTS) if STRAY.search(text)]
        assert not stray, f"{path} shows {stray}"
    assert not errors, errors


def _script_page(page, server, tmp_path, name: str, code: str) -> list[str]:
    """Run `code` as a script job to its end and open its page: the page's errors, as they come."""
    (tmp_path / f"{name}.py").write_text(code)
    script = {"command": f"python {name}.py", "files": [f"{name}.py"]}
    spec = write_spec(tmp_path / f"{name}.yaml", {"name": name, "kind": "script", "script": script})
    job_id = server.client().submit(load_spec(spec))["id"]
    wait_state(server.url, server.key, job_id)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    sign_in(page, server.url, server.key, path=f"/jobs/{job_id}")
    return errors


def test_a_script_job_that_reports_no_metric_shows_its_log_and_says_no_metrics_yet(
    page, dashboard_server, tmp_path
):
    errors = _script_page(page, dashboard_server, tmp_path, "quiet", "print('working, without a metric')\n")
    expect(page.get_by_text("no metrics yet")).to_be_visible()
    expect(page.locator("pre#log")).to_contain_text("working, without a metric")
    expect(page.locator("#timeline li[data-event=finished]")).to_have_count(1)
    page.wait_for_load_state("networkidle")
    stray = [text for text in page.evaluate(TEXTS) if STRAY.search(text)]  # a script's summary has gaps
    assert not stray and not errors, (stray, errors)


def test_a_script_job_that_reports_through_track_draws_its_curves(page, dashboard_server, tmp_path):
    loop = (
        "from gpuforge import track\nfor i in range(12):\n    track.log(i, loss=1 / (i + 1), accuracy=i / 12)"
    )
    errors = _script_page(page, dashboard_server, tmp_path, "tracked", loop)
    wait_for(lambda: points(page) == 12, 15, what="a loss chart with the script's 12 points")
    assert points(page, "accuracy") == 12  # any figure the script logs gets its curve
    expect(page.locator(".chart[data-metric=loss]").locator("canvas, svg").first).to_be_visible()
    expect(page.get_by_text("no metrics yet")).to_be_hidden()
    expect(page.locator(".chart[data-metric=ts]")).to_have_count(0)  # a line's time is not a figure
    texts = page.evaluate(TEXTS)
    assert "11" in texts and not [t for t in texts if t.endswith("/?")], texts  # no total: the step alone
    assert not errors, errors


def test_gpuforge_dashboard_shows_run_directories_read_only_with_its_key(page, tmp_path):
    runs = tmp_path / "runs"
    spec = write_spec(tmp_path / "local.yaml", _spec(tmp_path, name="digits-local", lr="auto"))
    trained = run_cli("train", str(spec), "--out", str(runs / "digits-local"), timeout=300)
    assert trained.returncode == 0, trained.stderr
    process, url, key = start_local_dashboard(runs, tmp_path / "dashboard.log")
    try:
        sign_in(page, url, "gfd_not-the-key", wait=False)
        expect(page.locator("#signin-error")).to_have_text("key not accepted")
        sign_in(page, url, key)  # the key it printed
        rows = page.locator("table#jobs tr[data-job-id]")
        expect(rows).to_have_count(1)
        expect(page.locator("form#signin")).to_be_hidden()
        assert page.locator("form#submit").count() == 0
        job_id = rows.first.get_attribute("data-job-id")
        page.goto(f"{url}/jobs/{quote(job_id)}")
        wait_for(lambda: points(page), 15, what="a loss chart with points")
        assert points(page) == 12
        assert page.locator("form#submit").count() == 0
        # train.lr auto: the range test's curve, and the rate it picked with the rule
        found = json.loads((runs / "digits-local" / "lr_find.json").read_text())
        wait_for(lambda: points(page, "lr_find"), 15, what="the range test's chart")
        assert points(page, "lr_find") == found["steps"]
        said = page.locator("#lr-find p")
        expect(said).to_contain_text(found["reason"])
        assert float(said.get_attribute("data-lr")) == pytest.approx(found["lr"])
    finally:
        stop(process)
