"""LoRA adapters added to a running deployment and taken away, through a real server (`gpuforge server`
on loopback) and real replicas: no replica restarts (same pids), the new adapter answers at once, the
others still do."""

import os

import httpx
import pytest
import yaml

from gpuforge.server.local import LocalServer
from tests.helpers.jobs import wait_for
from tests.helpers.paths import TOPICS
from tests.helpers.processes import kill_processes_under

pytestmark = pytest.mark.slow


def _lora_spec(name: str, bert, topics, seed: int) -> str:
    return yaml.safe_dump({
        "name": name,
        "model": {"source": f"hf:{bert}", "task": "sequence-classification"},
        "data": {"train": str(topics), "max_length": 16, "eval_fraction": 0.25},
        "train": {"max_steps": 4, "batch_size": 8, "lr": 2e-2, "precision": "fp32", "seed": seed},
        "adapt": {"lora": {"r": 4}},
    })  # fmt: skip


def test_an_adapter_joins_a_running_deployment_without_a_restart(tmp_path, tiny_bert_dir):
    topics = tmp_path / "data" / "topics.jsonl"
    topics.parent.mkdir()
    topics.write_text("\n".join(TOPICS.read_text().splitlines()[:96]) + "\n")
    roots = os.pathsep.join(map(str, (tiny_bert_dir, topics.parent)))
    server = LocalServer(tmp_path / "home", log=tmp_path / "server.log", GPUFORGE_CPU_SLOTS="2",
                         GPUFORGE_DATA_ROOTS=roots)  # fmt: skip
    try:
        _add_and_remove(server, tiny_bert_dir, topics)
    finally:
        kill_processes_under(tmp_path)


def _add_and_remove(server, tiny_bert_dir, topics):
    with server, httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"},
                              timeout=60) as http:  # fmt: skip
        ids = {}
        for seed, name in enumerate(("own", "sports", "finance")):
            ids[name] = http.post(
                "/api/v1/jobs", json={"spec": _lora_spec(name, tiny_bert_dir, topics, seed)}
            ).json()["id"]
        for job_id in ids.values():
            wait_for(http, f"/api/v1/jobs/{job_id}", lambda j: j["state"] in ("finished", "failed"))
        made = http.post("/api/v1/deployments", json={"job_id": ids["own"], "name": "topics", "replicas": 2})
        assert made.status_code == 201, made.text
        before = wait_for(http, "/api/v1/deployments/topics", lambda d: d["state"] == "ready")
        pids = {w["index"]: w["pid"] for w in before["workers"]}

        added = http.post("/api/v1/deployments/topics/adapters", json={"job_id": ids["sports"]})
        assert added.status_code == 201 and added.json()["adapters"] == ["sports"], added.text
        named = http.post(
            "/api/v1/deployments/topics/adapters", json={"job_id": ids["finance"], "name": "money"}
        )
        assert named.status_code == 201 and named.json()["adapters"] == ["money", "sports"]
        served = wait_for(http, "/api/v1/deployments/topics",
                       lambda d: all(w["adapters"] == ["money", "sports"] for w in d["workers"]))  # fmt: skip
        assert [w["restarts"] for w in served["workers"]] == [0, 0]
        assert [w["port"] for w in served["workers"]] == [w["port"] for w in before["workers"]]
        for adapter in ("sports", "money", None):  # each replica answers with each adapter
            body = {"inputs": ["the striker scored twice"], **({"adapter": adapter} if adapter else {})}
            for _ in range(4):
                answer = http.post("/api/v1/deployments/topics/predict", json=body)
                assert answer.status_code == 200, answer.text
        assert pids == {w["index"]: w["pid"] for w in served["workers"]} and all(pids.values())

        wrong = http.post(
            "/api/v1/deployments/topics/adapters", json={"job_id": ids["sports"], "name": "money"}
        )
        assert wrong.status_code == 409  # the name is another job's
        gone = http.delete("/api/v1/deployments/topics/adapters/sports")
        assert gone.status_code == 200 and gone.json()["adapters"] == ["money"]
        wait_for(
            http,
            "/api/v1/deployments/topics",
            lambda d: all(w["adapters"] == ["money"] for w in d["workers"]),
        )
        for _ in range(4):
            refused = http.post(
                "/api/v1/deployments/topics/predict", json={"inputs": ["x"], "adapter": "sports"}
            )
            assert refused.status_code == 404 and "sports" in refused.json()["detail"]
        assert (
            http.post(
                "/api/v1/deployments/topics/predict", json={"inputs": ["x"], "adapter": "money"}
            ).status_code
            == 200
        )
        assert http.delete("/api/v1/deployments/topics/adapters/sports").status_code == 404
        events = [e["kind"] for e in http.get("/api/v1/deployments/topics/events").json()]
        assert events == ["adapter_added", "adapter_added", "adapter_removed"]
