"""What `gpuforge submit` checks on the client before it sends anything."""

import pytest

from gpuforge.client import check_local_files
from gpuforge.errors import GpuforgeError
from gpuforge.spec import parse_spec


def test_a_relative_path_must_be_here_and_an_absolute_one_may_be_the_servers(tmp_path):
    model = {"source": "bundled:gpt-tiny", "task": "causal-lm"}
    written = {"model": model, "data": {"train": "corpus.txt"}}
    spec = parse_spec({**written, "data": dict(written["data"])}, tmp_path)
    with pytest.raises(GpuforgeError, match="^data.train: corpus.txt: no such file$"):
        check_local_files(spec, written)
    on_server = {"model": model, "data": {"train": "/srv/shared/corpus.txt"}}  # under the server's roots
    check_local_files(parse_spec({**on_server, "data": dict(on_server["data"])}, tmp_path), on_server)
