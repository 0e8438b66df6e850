"""The README's `gpuforge serve` examples run as a newcomer runs them: each `gpuforge serve ... --port 8700`
line as written (on a free port, with a tiny trained model of the same kind) and every curl line after it
with the real curl, so that the README cannot drift from what serve takes and answers."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from gpuforge.runtime.host import free_port
from gpuforge.server.local import wait_until_ready
from tests.helpers.paths import ROOT
from tests.serve.tiny_runs import train_gpt, train_topics

README = ROOT / "README.md"
HERE = "localhost:8700"  # where the README's examples listen
CURL = shutil.which("curl")

pytestmark = pytest.mark.slow


def serve_examples() -> list[tuple[list[str], list[list[str]]]]:
    """(a `gpuforge serve` line, the curl lines after it that ask it) from the "Serve a model" section,
    each a list of words as the shell splits them, comments left out."""
    section = README.read_text().split("\n## Serve a model\n", 1)[1].split("\n## ", 1)[0]
    examples = []
    for block in re.findall(r"^\s*```bash\n(.*?)^\s*```", section, re.M | re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["gpuforge", "serve"] and " --port 8700" in shlex.join(words):
                examples.append((words, []))
            elif words[:1] == ["curl"] and _path(words) is not None:
                examples[-1][1].append(words)
    return examples


def _path(curl_words: list[str]) -> str | None:
    """The path a curl line asks on the README's server, or None for another address."""
    urls = [w for w in curl_words if w.startswith(HERE)]
    return urlsplit(f"http://{urls[0]}").path if urls else None


EXAMPLES = serve_examples()
PATHS = [sorted({_path(words) for words in curls}) for _, curls in EXAMPLES]


def test_the_readme_shows_serve_with_curl_for_classifiers_and_causal_lms():
    assert {"/predict", "/info", "/v1/completions", "/v1/chat/completions"} <= set().union(*PATHS)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tiny_bert_dir) -> dict[str, object]:
    return {
        "classifier": train_topics(tmp_path_factory.mktemp("readme-topics"), tiny_bert_dir),
        "causal-lm": train_gpt(tmp_path_factory.mktemp("readme-gpt")),
    }


@pytest.mark.skipif(CURL is None, reason="no curl on this machine: the README's examples are curl lines")
@pytest.mark.parametrize(("serve_words", "curls"), EXAMPLES, ids=["+".join(paths) for paths in PATHS])
def test_a_readme_serve_example_answers_as_written(serve_words, curls, tiny_models, tmp_path):
    causal = any(_path(words).startswith("/v1/") for words in curls)
    model_dir = tiny_models["causal-lm" if causal else "classifier"]
    port = str(free_port())
    options = serve_words[3:]  # after `gpuforge serve MODEL_DIR`
    options[options.index("--port") + 1] = port
    args = [str(model_dir), *options]
    env = {k: v for k, v in os.environ.items() if k != "GPUFORGE_API_KEY"}  # loopback needs no key
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "gpuforge", "serve", *args], env=env, stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    try:
        assert wait_until_ready(f"http://127.0.0.1:{port}", process, 90), (tmp_path / "serve.log").read_text()
        for words in curls:
            words = [w.replace(HERE, f"localhost:{port}") for w in words]
            done = subprocess.run(
                [CURL, *words[1:], "--silent", "--show-error", "--write-out", "\n%{http_code}"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            body, _, code = done.stdout.rpartition("\n")
            assert (done.returncode, code) == (0, "200"), f"{shlex.join(words)}\n{body}{done.stderr}"
            _check_answer(body, words)
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _check_answer(body: str, words: list[str]) -> None:
    """What the README's comment and the route promise: JSON, or events ending in [DONE] for a stream."""
    if '"stream": true' in " ".join(words):
        events = [line for line in body.splitlines() if line]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        assert json.loads(events[0][6:])["choices"], body
        return
    answer = json.loads(body)
    path = urlsplit(f"http://{next(w for w in words if w.startswith('localhost:'))}").path
    expected = {"/predict": "outputs", "/info": "task"}.get(path, "choices")  # choices: /v1/...
    assert expected in answer, body


def _search_lines() -> list[list[str]]:
    """The bash lines of the "Search hyperparameters" section, each as the shell splits it."""
    section = README.read_text().split("\n## Search hyperparameters\n", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_readme_search_runs_as_written_and_shows_its_best_trial(tmp_path):
    from tests.helpers.cli import run_cli

    tune, show = _search_lines()
    assert tune[:2] == ["gpuforge", "tune"] and show[:3] == ["gpuforge", "tune", "show"]
    at = tune.index("--out") + 1
    out = tmp_path / "digits-search"
    assert show[3] == tune[at]  # show reads the folder the search wrote
    tune[at] = show[3] = str(out)
    result = run_cli(*tune[1:], "--max-trials", "3", cwd=ROOT)  # a search's worth of trials, but fewer
    assert result.returncode == 0, result.stderr
    shown = run_cli(*show[1:], "--json", cwd=ROOT)
    doc = json.loads(shown.stdout)
    assert doc["state"] == "finished" and len(doc["trials"]) == 3
    best = doc["best"]
    assert best is not None and (out / "trials" / f"trial-{best['trial']:04d}" / "model").is_dir()
