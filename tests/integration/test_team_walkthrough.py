"""The README's team walk-through, run with the real CLI in its order on a fresh server with one CPU slot and
with two: a project and its keys (and one outside), jobs submitted and waited for, a deployment, a job that
waits behind its replica (and says so), a new version rolled out (in place, where no device is free), a
rollback, a cancel that a resume takes up from its checkpoint, and the costs."""

import json
import time

import httpx
import pytest

from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.paths import TEST_MODELS
from tests.helpers.specs import image_spec, write_spec

pytestmark = pytest.mark.slow


# what `gpuforge job ID --json` and `gpuforge deployments NAME --json` print: the API's answer, as it is
READS = {"job": "/api/v1/jobs/{}", "deployments": "/api/v1/deployments/{}"}


class Team:
    """The CLI as each person of the team runs it (their own key)."""

    def __init__(self, server: LocalServer):
        self.url = server.url
        self.env = {"GPUFORGE_URL": server.url}
        self.keys = {"admin": server.key}

    def run(self, who: str, *args: str, ok: bool = True, timeout: float = 300):
        done = run_cli(*args, env={**self.env, "GPUFORGE_API_KEY": self.keys[who]}, timeout=timeout)
        if ok:
            assert done.returncode == 0, f"{who}: gpuforge {' '.join(args)}: {done.stderr}"
        return done

    def json(self, who: str, *args: str):
        return json.loads(self.run(who, *args, "--json").stdout)

    def until(self, who: str, args: tuple[str, ...], check, timeout: float = 180.0):
        """What `gpuforge ARGS --json` prints once `check` holds for it: polled through the API it reads
        (a process a poll cost a second of CPU), then asked of the CLI itself, which must say so too."""
        verb, name = args
        headers = {"authorization": f"Bearer {self.keys[who]}"}
        deadline, found = time.monotonic() + timeout, None
        with httpx.Client(base_url=self.url, headers=headers, timeout=60) as http:
            while time.monotonic() < deadline:
                answer = http.get(READS[verb].format(name))
                assert answer.status_code == 200, f"gpuforge {' '.join(args)}: {answer.text}"
                if check(answer.json()) and check(found := self.json(who, *args)):
                    return found
                time.sleep(0.25)
        raise AssertionError(f"gpuforge {' '.join(args)} never got there: {found or answer.json()}")


@pytest.mark.parametrize("slots", [1, 2])
def test_a_teams_first_day_on_one_server(tmp_path, slots):
    server = LocalServer(tmp_path / "home", log=tmp_path / "server.log", GPUFORGE_CPU_SLOTS=str(slots),
                         GPUFORGE_DATA_ROOTS=str(TEST_MODELS.parent),
                         GPUFORGE_ALLOW_USER_CODE="true")  # the tiny digits model is python:  # fmt: skip
    with server:
        team = Team(server)
        team.run("admin", "projects", "create", "vision", "--budget-usd-month", "50")
        for name, project in (("ada", "vision"), ("bob", "vision"), ("eve", None)):
            joins = ["--project", project] if project else []
            team.keys[name] = team.json("admin", "keys", "create", name, *joins)["key"]

        good = write_spec(tmp_path / "good.yaml", image_spec(tmp_path, max_steps=30, seed=1))
        other = write_spec(tmp_path / "other.yaml", image_spec(tmp_path, max_steps=30, seed=2))
        first = team.json("ada", "submit", str(good))["id"]
        second = team.json("ada", "submit", str(other))["id"]
        team.run("ada", "wait", str(first), str(second))

        # the deployment: on one slot, it says at once that it takes what jobs would run on
        made = team.run("ada", "deploy", str(first), "--name", "digits", "--wait")
        assert "ready, v1" in made.stdout
        took_all = "can take every cpu device this server has (1)" in made.stderr
        assert took_all == (slots == 1), made.stderr

        # two steps a second (a step and its checkpoints cost ~50 ms of CPU): long enough never to finish
        long = image_spec(tmp_path, max_steps=2000, seed=3, checkpoint_every=5, options={"sleep_s": 0.5})
        third = team.json("bob", "submit", str(write_spec(tmp_path / "long.yaml", long)))["id"]
        if slots == 1:  # it waits behind the replica, and its reason names it and what frees it
            named = lambda j: "deployment digits" in (j["reason"] or "")  # noqa: E731
            waiting = team.until("bob", ("job", str(third)), named)
            assert waiting["state"] == "queued" and "gpuforge undeploy digits" in waiting["reason"], waiting
        else:
            team.until("bob", ("job", str(third)), lambda j: j["state"] == "running")
        assert "404" in team.run("eve", "cancel", str(third), ok=False).stderr  # outside the project
        assert team.json("eve", "deployments") == []

        # a new version: measured, then rolled out (in place where no device is free for a second replica)
        rolled = team.run("ada", "deploy", str(second), "--name", "digits", "--max-metric-drop", "0.5",
                          "--wait", "--timeout", "240")  # fmt: skip
        assert "ready, v2" in rolled.stdout, rolled.stderr
        assert "rolling out" in rolled.stderr  # the progress it printed while it waited
        kinds = [e["kind"] for e in team.json("ada", "deployments", "digits", "--events")]
        assert kinds[:2] == ["rolling", "replaced_in_place"] and kinds[-1] == "rolled_out", kinds
        bob = {"authorization": f"Bearer {team.keys['bob']}"}
        answer = httpx.post(f"{server.url}/api/v1/deployments/digits/predict", headers=bob, timeout=60,
                            json={"inputs": [[[0.5] * 8] * 8]})  # fmt: skip
        assert answer.status_code == 200 and answer.headers["x-gpuforge-version"] == "2", answer.text

        team.run("ada", "rollback", "digits")
        team.until("ada", ("deployments", "digits"), lambda d: d["version"] == 1 and d["state"] == "ready")
        versions = {v["version"]: v for v in team.json("ada", "deployments", "digits", "--versions")}
        assert versions[1]["state"] == "serving" and versions[2]["state"] == "retired", versions

        if slots == 1:  # no device for another deployment: --wait gives up in time, saying who holds it
            stuck = team.run(
                "ada", "deploy", str(first), "--name", "spare", "--wait", "--timeout", "3", ok=False
            )
            assert (
                "gave up waiting after 3 s" in stuck.stderr and "waiting (no cpu device free" in stuck.stderr
            )
            assert "cpu:0 held by replica" in stuck.stderr and "of deployment digits" in stuck.stderr
            team.run("ada", "undeploy", "spare")

        # the slot goes back to the queue; bob's job runs, is cancelled at a checkpoint, and resumes
        team.run("ada", "undeploy", "digits")
        team.until("bob", ("job", str(third)), lambda j: j["state"] == "running" and (j["step"] or 0) >= 6)
        cancelled = team.run("bob", "cancel", str(third))
        assert "cancelling at its next step, after a checkpoint" in cancelled.stdout, cancelled.stdout
        assert "cancelled at step" in cancelled.stdout and f"gpuforge resume {third}" in cancelled.stdout
        at = team.json("bob", "job", str(third))["step"]
        resumed = team.run("bob", "resume", str(third))
        assert "queued (resumed by bob with no budget)" in resumed.stdout, resumed.stdout
        team.until("bob", ("job", str(third)), lambda j: j["state"] == "running" and j["step"] > at)
        events = httpx.get(f"{server.url}/api/v1/jobs/{third}/events", headers=bob, timeout=60).json()
        starts = [e for e in events if e["kind"] == "started"]
        assert starts[-1]["data"]["resumed_from"] >= at - 5  # its last checkpoint: the cancel's own
        team.run("bob", "cancel", str(third), "--no-wait")

        spent = {g["key"]: g for g in team.json("admin", "costs", "--by", "key")["groups"]}
        assert {"ada", "bob"} <= set(spent), spent
        assert team.json("eve", "costs")["total_usd"] == 0  # another's spending is not hers to see
