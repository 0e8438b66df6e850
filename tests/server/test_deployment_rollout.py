"""A deployment's life with real processes behind a real server (`gpuforge server` on loopback): a new
version rolled out under continuous load with no failed request, a version refused for a worse eval
metric, a rollback, replicas scaled 1 -> 2 under load and down to 0 when idle, then woken by a request."""

import threading
import time
from collections import Counter

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.jobs import wait_for
from tests.helpers.paths import TEST_MODELS
from tests.helpers.processes import kill_processes_under
from tests.helpers.specs import image_spec

pytestmark = pytest.mark.slow
IMAGE = [[0.5] * 8] * 8  # one 8x8 digit
PORTS = range(47100, 47200)  # GPUFORGE_REPLICA_PORTS: where its replicas listen


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A server with two CPU slots, its admin client, and three finished digits jobs: two good models
    (30 steps, two seeds) and a bad one (one step at a tiny learning rate)."""
    tmp = tmp_path_factory.mktemp("rollout")
    server = LocalServer(tmp / "home", log=tmp / "server.log", GPUFORGE_CPU_SLOTS="2",
                         GPUFORGE_DATA_ROOTS=str(TEST_MODELS.parent),
                         GPUFORGE_REPLICA_PORTS=f"{PORTS.start}-{PORTS.stop - 1}")  # fmt: skip
    with server:
        http = httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}, timeout=90
        )
        specs = [image_spec(tmp, max_steps=30, seed=1), image_spec(tmp, max_steps=30, seed=2),
                 image_spec(tmp, max_steps=1, lr=1e-6, seed=3)]  # fmt: skip
        ids = [http.post("/api/v1/jobs", json={"spec": yaml.safe_dump(s)}).json()["id"] for s in specs]
        for job_id in ids:
            wait_for(http, f"/api/v1/jobs/{job_id}", lambda j: j["state"] in ("finished", "failed"))
        http.env = {"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key}  # for the CLI's verbs
        yield http, ids
        http.close()
    kill_processes_under(tmp)


@pytest.fixture(autouse=True)
def undeploy_what_a_test_left(live):
    """A test that fails midway leaves its deployment holding devices: stop it, for the next test."""
    yield
    http, _ = live
    for left in http.get("/api/v1/deployments").json():
        http.delete(f"/api/v1/deployments/{left['name']}")
        wait_for(http, f"/api/v1/deployments/{left['name']}", lambda d: d["state"] in ("stopped", "failed"))


def _serving(http, name, version):
    return wait_for(http, f"/api/v1/deployments/{name}/versions",
                 lambda vs: any(v["version"] == version and v["state"] == "serving" for v in vs))  # fmt: skip


class Load:
    """`clients` threads sending requests one after another until stopped: each answer's status and the
    version that answered, in order, per client."""

    def __init__(self, http, name, clients=2):
        self.answers = [[] for _ in range(clients)]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(http, name, a)) for a in self.answers]

    def _run(self, http, name, answers):
        with httpx.Client(base_url=http.base_url, headers=http.headers, timeout=90) as own:
            while not self.stop.is_set():
                answer = own.post(f"/api/v1/deployments/{name}/predict", json={"inputs": [IMAGE]})
                answers.append((answer.status_code, answer.headers.get("x-gpuforge-version")))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def counts(self) -> list[int]:
        return [len(answers) for answers in self.answers]

    def wait_past(self, counts: list[int] | None = None, timeout: float = 60.0) -> None:
        """Until every client has an answer past `counts` (how many it had; None: any answer at all)."""
        counts = counts or [0] * len(self.answers)
        deadline = time.monotonic() + timeout
        while any(len(answers) <= n for answers, n in zip(self.answers, counts, strict=True)):
            alive = all(t.is_alive() for t in self.threads)
            assert alive and time.monotonic() < deadline, f"no answer within {timeout} s: {self.counts()}"
            time.sleep(0.05)

    def __exit__(self, *_):
        self.stop.set()
        for t in self.threads:
            t.join()


def test_a_new_version_rolls_out_under_load_without_a_failed_request(live):
    http, (good, other, _) = live
    made = http.post("/api/v1/deployments", json={"job_id": good, "name": "roll"})
    assert made.status_code == 201, made.text
    wait_for(http, "/api/v1/deployments/roll", lambda d: d["state"] == "ready")
    with Load(http, "roll") as load:
        load.wait_past()  # every client answered by v1 before the rollout
        # another seed: a few points apart on the held-out split, which this tolerance allows
        second = http.post(
            "/api/v1/deployments", json={"job_id": other, "name": "roll", "max_metric_drop": 0.3}
        )
        assert second.status_code == 201 and second.json()["rolling_version"] == 2, second.text
        again = http.post("/api/v1/deployments", json={"job_id": other, "name": "roll"})
        assert again.status_code == 409 and "v2 of 'roll' is rolling out" in again.json()["detail"]
        _serving(http, "roll", 2)  # once v1's replica has gone
        load.wait_past(load.counts())  # and every client answered since
    for answers in load.answers:
        assert answers and all(status == 200 for status, _ in answers), Counter(answers)
        seen = [version for _, version in answers]
        changes = sum(1 for a, b in zip(seen, seen[1:], strict=False) if a != b)
        assert seen[0] == "1" and seen[-1] == "2" and changes == 1, Counter(seen)
    listed = {v["version"]: v for v in http.get("/api/v1/deployments/roll/versions").json()}
    assert listed[1]["state"] == "retired" and listed[2]["state"] == "serving"
    assert all(
        v["metric"]["metric"] == "accuracy" and 0 <= v["metric"]["value"] <= 1 for v in listed.values()
    )
    kinds = [e["kind"] for e in http.get("/api/v1/deployments/roll/events").json()]
    assert kinds == ["rolling", "rolled_out"]
    d = http.get("/api/v1/deployments/roll").json()
    assert d["version"] == 2 and d["job_id"] == other and len(d["workers"]) == 1
    assert d["workers"][0]["port"] in PORTS
    assert http.delete("/api/v1/deployments/roll").status_code == 200
    wait_for(http, "/api/v1/deployments/roll", lambda d: d["state"] == "stopped")


def test_a_worse_version_is_refused_and_a_rollback_serves_the_one_before(live):
    http, (good, other, bad) = live
    assert http.post("/api/v1/deployments", json={"job_id": good, "name": "guard"}).status_code == 201
    wait_for(http, "/api/v1/deployments/guard", lambda d: d["state"] == "ready")
    worse = run_cli("deploy", str(bad), "--name", "guard", "--wait", env=http.env)  # the CLI waits for it
    assert worse.returncode != 0 and "v2 refused: eval accuracy" in worse.stderr, worse.stderr
    refused = http.get("/api/v1/deployments/guard/versions").json()[0]
    assert refused["version"] == 2 and refused["state"] == "refused", refused
    assert "worse than v1's" in refused["reason"] and "max_metric_drop 0.01" in refused["reason"]
    answer = http.post("/api/v1/deployments/guard/predict", json={"inputs": [IMAGE]})
    assert answer.status_code == 200 and answer.headers["x-gpuforge-version"] == "1"
    d = wait_for(http, "/api/v1/deployments/guard", lambda d: all(w["version"] == 1 for w in d["workers"]))
    assert d["version"] == 1 and d["rolling_version"] is None

    nothing_before = http.post("/api/v1/deployments/guard/rollback", json={})
    assert nothing_before.status_code == 409 and "served no version before" in nothing_before.json()["detail"]
    allowed = run_cli(
        "deploy", str(other), "--name", "guard", "--max-metric-drop", "0.3", "--wait", env=http.env
    )
    assert allowed.returncode == 0 and "ready, v3" in allowed.stdout, allowed.stderr
    back = run_cli("rollback", "guard", env=http.env)
    assert back.returncode == 0 and "v1 rolling out" in back.stdout, back.stderr
    _serving(http, "guard", 1)
    listed = run_cli("deployments", "guard", "--versions", env=http.env)
    assert listed.returncode == 0 and "refused" in listed.stdout and "retired" in listed.stdout, listed.stdout
    answer = http.post("/api/v1/deployments/guard/predict", json={"inputs": [IMAGE]})
    assert answer.headers["x-gpuforge-version"] == "1"
    assert http.post("/api/v1/deployments/guard/rollback", json={"to": 2}).status_code == 409  # refused one

    broken = http.get(f"/api/v1/jobs/{bad}").json()["run_dir"] + "/model/model.safetensors"
    with open(broken, "r+b") as weights:
        weights.truncate(100)  # a model that will not load
    assert http.post("/api/v1/deployments", json={"job_id": bad, "name": "guard"}).status_code == 201
    failed = wait_for(http, "/api/v1/deployments/guard/versions", lambda vs: vs[0]["state"] != "rolling")[0]
    assert failed["version"] == 4 and failed["state"] == "failed" and "would not serve" in failed["reason"]
    assert http.get("/api/v1/deployments/guard").json()["state"] == "ready"
    assert http.delete("/api/v1/deployments/guard").status_code == 200
    wait_for(http, "/api/v1/deployments/guard", lambda d: d["state"] == "stopped")


def test_two_replicas_on_two_devices_roll_out_and_back_under_load(live):
    """No device is free for an extra replica: an old one goes only while another serves; a rollback
    during (or just after) the rollout brings every replica back to v1, with no failed request."""
    http, (good, other, _) = live
    assert (
        http.post("/api/v1/deployments", json={"job_id": good, "name": "pair", "replicas": 2}).status_code
        == 201
    )
    wait_for(http, "/api/v1/deployments/pair", lambda d: d["state"] == "ready")
    with Load(http, "pair", clients=4) as load:
        load.wait_past()  # every client answered before the rollout
        body = {"job_id": other, "name": "pair", "max_metric_drop": 0.3}
        assert http.post("/api/v1/deployments", json=body).status_code == 201
        wait_for(
            http,
            "/api/v1/deployments/pair",
            lambda d: any(w["ready"] and w["version"] == 2 for w in d["workers"]),
        )
        back = http.post("/api/v1/deployments/pair/rollback", json={})
        assert back.status_code == 200, back.text

        def home(d):
            workers = sorted((w["version"], w["ready"]) for w in d["workers"])
            return d["version"] == 1 and d["rolling_version"] is None and workers == [(1, True), (1, True)]

        wait_for(http, "/api/v1/deployments/pair", home)
        load.wait_past(load.counts())  # and every client answered since
    statuses = Counter(status for answers in load.answers for status, _ in answers)
    assert set(statuses) == {200}, statuses
    assert (
        http.post("/api/v1/deployments/pair/predict", json={"inputs": [IMAGE]}).headers["x-gpuforge-version"]
        == "1"
    )
    assert http.delete("/api/v1/deployments/pair").status_code == 200
    wait_for(http, "/api/v1/deployments/pair", lambda d: d["state"] == "stopped")


def test_replicas_scale_up_under_load_down_to_zero_when_idle_and_wake_on_a_request(live):
    http, (good, _, _) = live
    made = http.post("/api/v1/deployments", json={"job_id": good, "name": "elastic", "min_replicas": 0,
                                                  "max_replicas": 2, "target_queue": 1,
                                                  "scale_down_after_s": 2})  # fmt: skip
    assert made.status_code == 201 and made.json()["replicas"] == 1, made.text
    wait_for(http, "/api/v1/deployments/elastic", lambda d: d["state"] == "ready")
    with Load(http, "elastic", clients=8) as load:
        both = lambda d: d["replicas"] == 2 and sum(w["ready"] for w in d["workers"]) == 2  # noqa: E731
        wait_for(http, "/api/v1/deployments/elastic", both, timeout=60)
    assert all(status == 200 for answers in load.answers for status, _ in answers)
    idle = wait_for(
        http, "/api/v1/deployments/elastic", lambda d: d["replicas"] == 0 and not d["workers"], 60
    )
    assert idle["state"] == "ready"
    devices = http.get("/api/v1/devices").json()
    assert all(d["held_by"] is None for d in devices)  # its devices are free for jobs

    woke = http.post("/api/v1/deployments/elastic/predict", json={"inputs": [IMAGE]})
    assert woke.status_code == 200 and int(woke.headers["x-gpuforge-held-ms"]) > 0, woke.text
    events = http.get("/api/v1/deployments/elastic/events").json()
    scaled = [(e["data"]["replicas_from"], e["data"]["replicas_to"]) for e in events if e["kind"] == "scaled"]
    assert scaled == [(1, 2), (2, 1), (1, 0), (0, 1)], events
    cold = [e["data"]["seconds"] for e in events if e["kind"] == "cold_start"]
    assert len(cold) == 1 and 0 < cold[0] < 60
    assert http.delete("/api/v1/deployments/elastic").status_code == 200
    wait_for(http, "/api/v1/deployments/elastic", lambda d: d["state"] == "stopped")
