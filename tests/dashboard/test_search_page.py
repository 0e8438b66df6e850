"""A search's page in Chromium against a real server: its trials (the pruned ones said so), their curves,
the best objective against money spent and the parallel coordinates (each chart's data-points), and
"deploy best" deploying the best trial's model."""

from __future__ import annotations

import httpx
import pytest
import yaml
from playwright.sync_api import expect

from tests.helpers.browser import auth, sign_in, wait_for
from tests.helpers.processes import kill_processes_under
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def search(dashboard_server, tmp_path_factory):
    """A finished search: the good rate first (the grid's order under seed 4), three hopeless ones pruned."""
    server = dashboard_server
    tune = {
        "objective": {"metric": "eval_accuracy"},
        "parameters": {"train.lr": {"choice": [0.02, 1.0e-7, 2.0e-7, 3.0e-7]}},
        "sampler": "grid", "seed": 4, "pruner": {"asha": {"min_steps": 10, "reduction_factor": 3}},
    }  # fmt: skip
    spec = {**image_spec(None, max_steps=200, eval_every=10, batch_size=64, options={"sleep_s": 0.01}),
            "tune": tune, "cost": {"usd_per_hour": 1.0}}  # fmt: skip
    body = {"spec": yaml.safe_dump(spec)}
    made = httpx.post(f"{server.url}/api/v1/searches", json=body, headers=auth(server.key))
    assert made.status_code == 201, made.text
    search_id = made.json()["id"]

    def ended():
        got = httpx.get(f"{server.url}/api/v1/searches/{search_id}", headers=auth(server.key)).json()
        return got["state"] == "finished" and got

    doc = wait_for(ended, 240, what="the search finished")
    try:
        yield search_id, doc
    finally:
        httpx.delete(f"{server.url}/api/v1/deployments/best-digits", headers=auth(server.key))
        kill_processes_under(server.home)


def test_the_search_page_shows_its_trials_charts_and_deploys_the_best(page, dashboard_server, search):
    search_id, doc = search
    sign_in(page, dashboard_server.url, dashboard_server.key, "/searches")
    expect(page.locator(f"table#searches tr[data-search-id='{search_id}']")).to_contain_text("finished")
    page.locator(f"table#searches a[href='/searches/{search_id}']").click()
    expect(page.locator("#search-title")).to_have_text(f"Search {search_id}: tiny-digits")
    rows = page.locator("table#trials tbody tr")
    expect(rows).to_have_count(4)
    expect(page.locator("table#trials tr[data-state=pruned]")).to_have_count(3)
    expect(page.locator("table#trials tr[data-state=pruned]").first).to_contain_text("pruned at step 10")
    expect(page.locator("#best")).to_have_attribute("data-trial", "0")
    evaluations = sum(len(t["curve"]) for t in doc["trials"])
    expect(page.locator(".chart[data-metric=curves]")).to_have_attribute("data-points", str(evaluations))
    expect(page.locator(".chart[data-metric=parallel]")).to_have_attribute("data-points", "4")
    expect(page.locator(".chart[data-metric=parallel] polyline.state-pruned")).to_have_count(3)
    expect(page.locator(".chart[data-metric=best-vs-spend]")).to_have_attribute("data-points", "4")

    page.fill("#deploy-best input[name=name]", "best-digits")
    page.click("#deploy-best button")
    expect(page.locator("#deployed")).to_contain_text("deployment best-digits")
    expect(page.locator("#deployed")).to_contain_text(f"job {doc['best']['job']}")
    where = f"{dashboard_server.url}/api/v1/deployments/best-digits"
    made = httpx.get(where, headers=auth(dashboard_server.key))
    assert made.status_code == 200 and made.json()["job_id"] == doc["best"]["job"]
