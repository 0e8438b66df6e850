"""What a script job uses from its folder but does not send is caught at `gpuforge submit`, naming it and
what to add to script.files, not minutes later on the server as a traceback; the server refuses a
command whose file was not sent; and a job that fails on an exception all the same has the exception and
its line as its reason, not the traceback."""

import json

import httpx
import pytest

from gpuforge.server.local import LocalServer
from tests.helpers.cli import run_cli
from tests.helpers.jobs import wait_for_job
from tests.helpers.specs import write_spec

pytestmark = pytest.mark.slow  # every test here is slow (docs/testing.md)

# runs by hand in its folder: its package, a folder it puts on sys.path, a config it is given, its data
TRAIN = """
import sys
sys.path.insert(0, "lib")
import helper
from mylib.model import build

config = open(sys.argv[2]).read()
rows = open("data/rows.txt").read()
print(build(), helper.X, config, rows)
"""


@pytest.fixture
def folder(tmp_path):
    work = tmp_path / "work"
    for path, text in {
        "train.py": TRAIN,
        "lib/helper.py": "X = 1\n",
        "mylib/__init__.py": "",
        "mylib/model.py": "from .layers import dense\n\ndef build():\n    return dense()\n",
        "mylib/layers.py": "def dense():\n    return 'dense'\n",
        "conf/a.yaml": "lr: 1\n",
        "data/rows.txt": "1\n2\n",
        "runs/last/log.txt": "an earlier run's output, by hand\n",
    }.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    return work


def _spec(folder, files, command="python train.py --config conf/a.yaml --out runs/last"):
    script = {"command": command, "files": files}
    return write_spec(folder / "job.yaml", {"name": "mine", "kind": "script", "script": script})


def test_submit_names_what_a_script_job_uses_and_does_not_send(folder, tmp_path, monkeypatch):
    ran = run_cli("train", str(_spec(folder, ["train.py"])), "--out", str(tmp_path / "here"))
    assert ran.returncode == 0, ran.stdout + ran.stderr  # by hand, in its folder, it finds everything

    with LocalServer(tmp_path / "home", log=tmp_path / "server.log") as server:
        monkeypatch.setenv("GPUFORGE_URL", server.url)
        monkeypatch.setenv("GPUFORGE_API_KEY", server.key)
        http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"})

        refused = run_cli("submit", str(_spec(folder, ["train.py"])))
        assert refused.returncode == 2, refused.stdout + refused.stderr
        said = " ".join(refused.stderr.split())  # one message, wrapped by the terminal's width
        assert "script.command names conf/a.yaml, which script.files does not send: add conf to" in said
        assert "train.py imports helper (lib/helper.py), which script.files does not send: add lib to" in said
        assert "train.py imports mylib.model (mylib), which script.files does not send: add mylib to" in said
        assert "Traceback" not in refused.stderr and "add runs" not in said  # --out: an output, not refused

        # a package half sent: the module its code reaches and that is left out is named
        part = run_cli(
            "submit", str(_spec(folder, ["train.py", "lib", "conf", "mylib/__init__.py", "mylib/model.py"]))
        )
        assert part.returncode == 2
        assert "mylib/model.py imports .layers (mylib/layers.py)" in " ".join(part.stderr.split())
        assert http.get("/api/v1/jobs").json() == []  # nothing was queued

        # the code's data is not sent: a warning (it might be an output), and the job fails on the server
        # with the exception and its line as its reason, not the traceback
        sent = run_cli("submit", str(_spec(folder, ["train.py", "lib", "conf", "mylib"])), "--json")
        assert sent.returncode == 0, sent.stderr
        warned = " ".join(sent.stderr.split())
        assert "warning: train.py names 'data/rows.txt', which script.files does not send" in warned
        assert "warning: script.command names runs/last, which script.files does not send" in warned
        job_id = json.loads(sent.stdout)["id"]
        job = wait_for_job(http, job_id, lambda j: j["state"] not in ("queued", "running"))
        assert job["state"] == "failed" and "Traceback" not in job["reason"], job
        assert job["reason"].startswith(
            "the script exited 1: FileNotFoundError: [Errno 2] No such file or directory: 'data/rows.txt' "
            "(at train.py line 8); its traceback is in logs/script.log; a server's copy of the job holds "
            "only the files script.files names"
        ), job["reason"]
        assert "Traceback (most recent call last)" in run_cli("logs", str(job_id)).stdout  # kept in the log

        # the server's own check, for a client that sent less than the command runs
        other = run_cli("submit", str(_spec(folder, ["train.py"], command="python other.py")))
        assert other.returncode == 2
        assert "script.command runs other.py, which script.files does not send" in other.stderr
