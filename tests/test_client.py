"""What `gpuforge submit` checks on the client before it sends anything."""

import pytest

from gpuforge.client import check_local_files
from gpuforge.errors import GpuforgeError
from gpuforge.server.local import LocalServer
from gpuforge.server.schemas import DEPLOYMENT_NAME
from gpuforge.spec import parse_spec
from tests.helpers.cli import run_cli


def test_a_relative_path_must_be_here_and_an_absolute_one_may_be_the_servers(tmp_path):
    model = {"source": "bundled:gpt-tiny", "task": "causal-lm"}
    written = {"model": model, "data": {"train": "corpus.txt"}}
    spec = parse_spec({**written, "data": dict(written["data"])}, tmp_path)
    with pytest.raises(GpuforgeError, match="^data.train: corpus.txt: no such file$"):
        check_local_files(spec, written)
    on_server = {"model": model, "data": {"train": "/srv/shared/corpus.txt"}}  # under the server's roots
    check_local_files(parse_spec({**on_server, "data": dict(on_server["data"])}, tmp_path), on_server)


@pytest.mark.slow
def test_a_refused_request_reads_as_one_line_naming_the_field_and_its_rule(tmp_path):
    """`gpuforge deploy` against a real server: the API's 422 list comes out as `field: rule`, not a dump."""
    with LocalServer(tmp_path / "home", log=tmp_path / "server.log", GPUFORGE_SCHEDULE="false") as server:
        env = {"GPUFORGE_URL": server.url, "GPUFORGE_API_KEY": server.key}
        named = run_cli("deploy", "1", "--name", "Topics v1", env=env, timeout=60)
        variant = run_cli("deploy", "1", "--name", "topics", "--model", "/tmp/model", env=env, timeout=60)
    assert named.returncode == 2 and variant.returncode == 2, (named, variant)  # a usage error
    prefix = "gpuforge: error: server answered 422: "
    said = [one_line(result.stderr) for result in (named, variant)]
    assert all(line.startswith(prefix) for line in said), said
    assert said[0] == f"{prefix}name: 'Topics v1' must match {DEPLOYMENT_NAME}", said
    assert said[1].startswith(f"{prefix}model: '/tmp/model' must match ^compressed/"), said
    for line in said:
        assert "'loc'" not in line and "string_pattern_mismatch" not in line, line


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0].strip()
