"""What a person reads on the pages, in Chromium against a real server on loopback: the names the user
gave the files a spec names (never an upload's hash), sizes in one unit, one cost, a job that is not
there, and how to submit a spec that names a file on the user's own machine."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from playwright.sync_api import expect

from gpuforge.spec import load_spec
from tests.helpers.browser import auth, cancel, sign_in, submit_form, text_of, wait_for, wait_state
from tests.helpers.paths import TEST_MODELS, TOPICS
from tests.helpers.processes import kill_processes_under
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow

UPLOAD_HASH = re.compile(r"uploads/[0-9a-f]{64}")


@pytest.fixture(scope="module")
def three_runs(dashboard_server, tmp_path_factory) -> list[tuple[int, str]]:
    """Three jobs sent by `gpuforge submit`'s client, each naming its own copy of the model's .py file
    in a long folder (as a user's project is): (id, the file's name on the user's machine). The first
    runs to its end; the other two are cancelled (their specs are what is compared)."""
    where = tmp_path_factory.mktemp("three") / "a-project-folder-with-a-long-name" / "experiments" / "models"
    where.mkdir(parents=True)
    server, runs = dashboard_server, []
    for i, variant in enumerate("abc"):
        model = where / f"variant_{variant}.py"
        model.write_text(TEST_MODELS.read_text() + f"\n# variant {variant}\n")  # a hash of its own
        spec = image_spec(where, max_steps=3)
        spec["name"] = f"variant-{variant}"
        spec["model"]["source"] = f"python:{model}:image_model"
        spec["cost"] = {"usd_per_hour": 3.7}  # a cost with digits past the fourth decimal
        job_id = server.client().submit(load_spec(write_spec(where / f"{variant}.yaml", spec)))["id"]
        if i:
            cancel(server.url, server.key, job_id)
        runs.append((job_id, str(model)))
    wait_state(server.url, server.key, runs[0][0])
    return runs


def test_compare_of_three_uploaded_runs_names_the_users_files_and_fits_the_page(
    page, dashboard_server, three_runs
):
    server = dashboard_server
    ids = ",".join(str(job_id) for job_id, _ in three_runs)
    sign_in(page, server.url, server.key, path=f"/compare?ids={ids}")
    row = page.locator("table#spec-diff tr[data-key='model.source']")
    expect(row).to_be_visible()
    cells = [cell.inner_text().strip() for cell in row.locator("td").all()]
    assert cells == [f"python:{model}:image_model" for _, model in three_runs], cells
    assert not UPLOAD_HASH.search(page.locator("table#spec-diff").inner_text())
    # every run's column on screen: the table no wider than its box, the box no wider than the page
    table_w, box_w, page_w = page.locator("table#spec-diff").evaluate(
        "t => [t.scrollWidth, t.parentElement.clientWidth, document.documentElement.clientWidth]"
    )
    assert table_w <= box_w <= page_w, (table_w, box_w, page_w)
    last = page.locator("table#spec-diff thead th").last.bounding_box()
    assert last["x"] + last["width"] <= page_w, last


def test_the_job_page_shows_the_users_file_names_sizes_in_one_unit_and_one_cost(
    page, dashboard_server, three_runs
):
    server = dashboard_server
    job_id, model = three_runs[0]
    sign_in(page, server.url, server.key, path=f"/jobs/{job_id}")
    spec = page.locator("pre#spec")
    expect(spec).to_contain_text(f"source: python:{model}:image_model")
    expect(page.locator("#summary tr[data-key=peak_mem_bytes]")).to_be_visible()
    shown = page.locator("#summary").inner_text() + spec.inner_text()
    assert not UPLOAD_HASH.search(shown), shown
    for row in page.locator("#summary tr[data-key]").all():
        key, value = row.get_attribute("data-key"), text_of(row, "td")
        if "bytes" in key:  # process_state_bytes.params as well as peak_mem_bytes: in binary units
            assert re.fullmatch(r"—|\d+(\.\d)? (B|KiB|MiB|GiB|TiB)", value), (key, value)
    header = text_of(page, ".job-head dd[data-field=cost]")
    assert re.fullmatch(r"\$\d+\.\d{2,4}", header), header
    expect(page.locator("#summary tr[data-key=cost_usd] td")).to_have_text(header)


def test_a_job_that_is_not_there_is_named_with_a_way_back(page, dashboard_server):
    server = dashboard_server
    sign_in(page, server.url, server.key, path="/jobs/99")
    expect(page.locator("#not-found")).to_contain_text("no job 99")
    page.locator("#not-found a").click()
    expect(page.locator("table#jobs")).to_be_visible()
    assert page.url.rstrip("/") == server.url


def test_a_spec_naming_a_file_outside_the_data_roots_says_how_to_send_it(page, dashboard_server, tmp_path):
    server = dashboard_server
    spec = image_spec(tmp_path)
    spec["data"]["train"] = str(TOPICS)  # the shipped example's data, on the user's machine
    sign_in(page, server.url, server.key)
    page.locator("form#submit textarea[name=spec]").fill(write_spec(tmp_path / "s.yaml", spec).read_text())
    submit_form(page, "form#submit")
    error = page.locator("#spec-error")
    expect(error).to_contain_text(f"data.train: {TOPICS} is outside the server's data roots")
    expect(error).to_contain_text("gpuforge submit SPEC.yaml")
    expect(error).to_contain_text("uploads the files")


def test_the_deployments_page_shows_the_version_and_a_readable_answer(page, dashboard_server, three_runs):
    """Last in the module: the deployment takes the server's one slot."""
    from sklearn.datasets import load_digits

    server = dashboard_server
    made = httpx.post(
        f"{server.url}/api/v1/deployments", json={"job_id": three_runs[0][0], "name": "digits-try"},
        headers=auth(server.key), timeout=30,
    )  # fmt: skip
    assert made.status_code == 201, made.text
    try:
        url = f"{server.url}/api/v1/deployments/digits-try"
        state = lambda: httpx.get(url, headers=auth(server.key)).json()["state"]  # noqa: E731
        wait_for(lambda: state() == "ready", 180, what="the deployment ready")
        sign_in(page, server.url, server.key, path="/deployments")
        expect(page.locator("tr[data-deployment=digits-try] td[data-field=version]")).to_have_text("v1")
        images = (load_digits().images[:2] / 16.0).tolist()
        page.locator("textarea[name=input]").fill(json.dumps(images))
        page.locator("button[data-action=predict]").click()
        answer = page.locator("pre#predict-answer")
        expect(answer).to_contain_text('"score"')
        text = answer.inner_text()
        shown = json.loads(text)  # still the JSON the API answered, pretty-printed
        assert len(shown["outputs"]) == 2 and "\n  " in text, text
        floats = re.findall(r"\d+\.\d+(?:e-?\d+)?", text)
        digits = [f.split("e")[0].replace(".", "").lstrip("0") for f in floats]
        assert floats and all(len(d) <= 4 for d in digits), floats  # 4 significant digits at most
    finally:
        httpx.delete(f"{server.url}/api/v1/deployments/digits-try", headers=auth(server.key), timeout=30)
        kill_processes_under(server.home)
