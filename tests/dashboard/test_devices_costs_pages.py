"""The devices and costs pages in Chromium against a real server (one CPU slot, no prices.yaml) where the
admin ran a job at its spec's rate and another key ran a job and serves it with one replica, unpriced:
what nobody priced reads "no price set" with the command that sets one, never $0; the replica's device is
busy; the costs table lists the days that spent, and the chart draws its last bar whole (issue 36)."""

from __future__ import annotations

import re

import httpx
import pytest
from playwright.sync_api import expect

from tests.helpers.browser import auth, make_key, sign_in, submit, text_of, wait_for, wait_state
from tests.helpers.processes import kill_processes_under
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow

# the pixels of the plotting area (uPlot's .u-over lies over it) that hold the bars' blue, by column
BAR_COLUMNS = """() => {
  const chart = document.querySelector(".chart[data-metric=costs]");
  const canvas = chart.querySelector("canvas");
  const over = chart.querySelector(".u-over");
  const ratio = canvas.width / canvas.getBoundingClientRect().width;
  const left = Math.round(over.offsetLeft * ratio), top = Math.round(over.offsetTop * ratio);
  const width = Math.round(over.offsetWidth * ratio), height = Math.round(over.offsetHeight * ratio);
  const pixels = canvas.getContext("2d").getImageData(left, top, width, height).data;
  const columns = [];
  for (let x = 0; x < width; x++) {
    for (let y = 0; y < height; y++) {
      const i = (y * width + x) * 4;
      if (pixels[i + 3] > 40 && pixels[i + 2] - pixels[i] > 60) { columns.push(x); break; }
    }
  }
  return { width, columns };
}"""


@pytest.fixture(scope="module")
def spent(dashboard_server, tmp_path_factory):
    """The admin's priced job, then dora's unpriced job and its deployment (which takes the one slot)."""
    server = dashboard_server
    where = tmp_path_factory.mktemp("spent")
    priced = image_spec(where, max_steps=6) | {"name": "priced", "cost": {"usd_per_hour": 0.5}}
    wait_state(server.url, server.key, submit(server.url, server.key, priced)["id"])
    dora = make_key(server.url, server.key, "dora")
    job_id = submit(server.url, dora, image_spec(where, max_steps=6) | {"name": "doras"})["id"]
    wait_state(server.url, dora, job_id)
    made = httpx.post(
        f"{server.url}/api/v1/deployments", json={"job_id": job_id, "name": "doras"}, headers=auth(dora)
    )
    assert made.status_code == 201, made.text

    def ready():
        got = httpx.get(f"{server.url}/api/v1/deployments/doras", headers=auth(dora)).json()
        return got["state"] == "ready"

    wait_for(ready, 180, what="the deployment ready")
    try:
        yield dora, job_id
    finally:
        httpx.delete(f"{server.url}/api/v1/deployments/doras", headers=auth(server.key))
        kill_processes_under(server.home)


def test_the_devices_page_shows_the_replica_busy_and_no_price_set(page, dashboard_server, spent):
    dora, _ = spent
    sign_in(page, dashboard_server.url, dora, "/devices")
    row = page.locator("table#devices tr[data-device-id='cpu:0']")
    expect(row.locator("[data-field=holder]")).to_have_text("doras replica 0")
    expect(row.locator("[data-field=name]")).to_have_text(re.compile(r"^the whole CPU: \d+ cores?$"))
    price = text_of(row, "[data-field=price]")
    assert price.startswith("no price set gpuforge prices set cpu --usd-per-hour N") and "$" not in price
    # busy: the replica and the jobs, from the ledger; the figure in all at least the last hour's
    wait_for(lambda: text_of(row, "[data-field=busy]") not in ("", "0% · 0.0 min"), 30, what="busy")
    assert text_of(row, "[data-field=busy_in_all]") not in ("", "0s")


def test_the_costs_page_says_no_price_set_lists_spent_days_and_draws_the_last_bar_whole(
    page, dashboard_server, spent
):
    dora, job_id = spent
    sign_in(page, dashboard_server.url, dashboard_server.key, "/costs")
    note = page.locator("#no-price")
    expect(note).to_contain_text(f"job {job_id} doras")
    expect(note).to_contain_text("deployment")
    expect(note.locator("code").first).to_have_text(
        "gpuforge prices set cpu --usd-per-hour N (on the server's machine, with its GPUFORGE_HOME)"
    )
    rows = page.locator("table#costs tbody tr")
    expect(rows).to_have_count(1)  # today alone: the 29 days that spent nothing are not rows
    cells = [c.strip() for c in rows.first.locator("td").all_inner_texts()]
    keys = [h.strip() for h in page.locator("table#costs thead th").all_inner_texts()][1:-1]
    assert keys == ["admin", "dora"]
    assert cells[0].startswith("$") and cells[1] == "no price set"
    assert cells[2].startswith("$") and cells[2].endswith(" + 2 unpriced")
    assert "$0.0000" not in page.locator("table#costs").inner_text()

    chart = page.locator(".chart[data-metric=costs]")
    expect(chart).to_have_attribute("data-points", "30")
    drawn = wait_for(lambda: (seen := page.evaluate(BAR_COLUMNS))["columns"] and seen, 15, what="bars drawn")
    # today's bar, the last: whole, with the plot's background beyond its right edge
    assert drawn["columns"][-1] < drawn["width"] - 2, drawn
