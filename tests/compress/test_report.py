"""The compress report a user reads: a sweep's table at 80 columns, latency with its spread, the front."""

import json
import os
import pty
import re
import subprocess
import sys

import pytest

from gpuforge.compress.report import add_deltas_and_front
from tests.helpers.runs import train_text_run as _text_run


def _in_a_terminal(*args: str, columns: int) -> str:
    """What `gpuforge ARGS` shows in a terminal `columns` wide (the CLI sizes tables only for a tty)."""
    main, child = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuforge", *args], stdout=child, stderr=subprocess.PIPE, env=env
    )
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    _, stderr = process.communicate(timeout=600)
    os.close(main)
    assert process.returncode == 0, stderr.decode()
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode()).replace("\r", "")


def test_a_sweep_table_reads_whole_at_80_columns(tmp_path, tiny_bert_dir, small_topics):
    model_dir = _text_run(tmp_path, tiny_bert_dir, small_topics, lora={"r": 4})
    shown = _in_a_terminal("compress", str(model_dir), "--sweep", "--out", str(tmp_path / "s"), columns=80)
    rows = json.loads((tmp_path / "s" / "report.json").read_text())["variants"]
    names = [v["name"] for v in rows]
    assert len(set(names)) == len(names) == 10 and rows[0]["adapter"]  # the original and nine variants
    lines = shown.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in shown
    body = lines[next(i for i, line in enumerate(lines) if "───" in line) + 1 :]
    assert [line.split()[0] for line in body if line.strip()][: len(names)] == names  # whole, a row each
    assert all(v["latency_spread_b32"] >= 0 and v["latency_ms_b32"] > 0 for v in rows)
    for v in rows:  # the spread is shown beside the figure it belongs to
        assert re.search(rf"^ ?{re.escape(v['name'])} .* ±{v['latency_spread_b32']:.0%} ", shown, re.M)


def _row(name, memory, latency, spread, accuracy):
    return {
        "name": name,
        "memory_bytes": memory,
        "disk_bytes": memory,
        "latency_ms_b32": latency,
        "latency_spread_b32": spread,
        "metric": {"name": "accuracy", "value": accuracy},
    }


@pytest.mark.parametrize(
    "spread, front",
    [(0.10, ["original", "int8"]), (0.01, ["original", "int8", "faster"])],
)
def test_latency_counts_as_better_only_beyond_its_spread(spread, front):
    # "faster" is 15% faster than the smaller "int8": a trade-off worth a star only beyond the noise
    rows = [
        _row("original", 100, 90, spread, 0.9),
        _row("int8", 25, 115, spread, 0.8),
        _row("faster", 30, 100, spread, 0.8),
        _row("as-fast-but-bigger", 40, 101, spread, 0.8),
    ]
    add_deltas_and_front(rows)
    assert [v["name"] for v in rows if v["pareto"]] == front
