"""The compress report a user reads: a sweep's table at 80 columns, latency with its spread, the front."""

import json
import os
import pty
import re
import subprocess
import sys

import pytest
from rich.console import Console

from gpuforge.compress.report import add_deltas_and_front, add_drift, latency_fields, size_text, table
from gpuforge.hardware.timing import Timing
from tests.helpers.output import OWN_LINE
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


@pytest.mark.slow
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
    for v in rows:  # sizes to three figures, each latency with its spread beside it, or '?' when unreliable
        assert v["latency_ms_b1"] > 0 and v["latency_spread_b32"] >= rows[0]["latency_drift_b32"]
        b1, b32 = (
            re.escape(f"±{v[f'latency_spread_b{n}']:.0%}" if v[f"latency_reliable_b{n}"] else "?")
            for n in (1, 32)
        )
        sizes = f"{size_text(v['disk_bytes'])} +{size_text(v['memory_bytes'])}"
        assert re.search(rf"^ ?{re.escape(v['name'])} .*{sizes} .*{b1} .*{b32} ", shown, re.M), v["name"]
    # the table says whether its latency can be trusted, as report.json does
    doubtful = [f"{v['name']} b{n}" for v in rows for n in (1, 32) if not v[f"latency_reliable_b{n}"]]
    said = " ".join(shown.split())  # the caption wraps
    assert (f"?: {len(doubtful)} of 20 latency figures are unreliable" in said) == bool(doubtful)
    assert "latency counts only where both figures are reliable" in said


def _steady(ms):  # runs within ±1 % of each other
    return Timing(tuple(ms / 1000 * f for f in (1.0, 1.02, 0.98, 1.0) * 2))


def _wavering(ms):  # windows ±10 % apart: reliable, but a smaller gain is inside it
    return Timing(tuple(ms / 1000 * f for f in (0.9, 0.9, 1.1, 1.1) * 2))


def _busy(ms):  # the machine got busy halfway: windows ±50 % apart
    return Timing(tuple(ms / 1000 * f for f in (0.5,) * 4 + (1.5,) * 4))


def _variant(name, memory, accuracy, b32, b1=_steady(1.0)):
    return {
        "name": name,
        "params": 1000,
        "nonzero_params": 1000,
        "memory_bytes": memory,
        "disk_bytes": memory,
        "metric": {"name": "accuracy", "value": accuracy},
        **latency_fields({1: b1, 32: b32}),
    }


@pytest.mark.parametrize(
    "timed, front",
    [
        (_steady, ["original", "int8", "faster"]),  # 13 % faster, beyond ±1 % spreads: a trade-off
        (_wavering, ["original", "int8"]),  # 13 % faster, inside ±10 % spreads: the machine's
    ],
)
def test_latency_counts_as_better_only_beyond_both_spreads(timed, front):
    rows = [
        _variant("original", 100_000, 0.9, timed(90)),
        _variant("int8", 25_000, 0.8, timed(115)),
        _variant("faster", 30_000, 0.8, timed(100)),
        _variant("as-fast-but-bigger", 40_000, 0.8, timed(101)),
    ]
    add_deltas_and_front(rows)
    assert [v["name"] for v in rows if v["pareto"]] == front


def test_an_unreliable_figure_decides_nothing_even_twice_as_fast():
    rows = [
        _variant("original", 100_000, 0.9, _steady(90)),
        _variant("int8", 25_000, 0.8, _steady(115)),
        _variant("faster-on-a-busy-machine", 30_000, 0.8, _busy(50)),  # beyond ±50 %, but unreliable
        _variant("faster-at-batch-1", 30_000, 0.8, _steady(115), b1=_steady(0.5)),
    ]
    add_deltas_and_front(rows)
    assert not rows[2]["latency_reliable_b32"] and rows[2]["latency_spread_b32"] == pytest.approx(0.5)
    assert [v["name"] for v in rows if v["pareto"]] == ["original", "int8", "faster-at-batch-1"]


def test_a_machine_that_slowed_down_during_the_sweep_makes_every_figure_unreliable():
    rows = [
        _variant("original", 120_000, 0.9, _steady(90)),
        _variant("int4", 21_000, 0.8, _steady(160)),
        _variant("faster", 30_000, 0.8, _steady(100)),
    ]
    first = {1: _steady(1.0), 32: _steady(90)}
    add_drift(rows, first, {1: _steady(3.0), 32: _steady(180)})  # the original again, 3x and 2x slower
    add_deltas_and_front(rows)
    drift = {n: rows[0][f"latency_drift_b{n}"] for n in (1, 32)}
    assert drift == {
        1: pytest.approx(0.5),
        32: pytest.approx(1 / 3),
    }  # half of 1..3 over 2, of 90..180 over 135
    for n in (1, 32):
        assert all(v[f"latency_spread_b{n}"] >= drift[n] and not v[f"latency_reliable_b{n}"] for v in rows)
    assert [v["name"] for v in rows if v["pareto"]] == ["original", "int4"]  # "faster" no longer counts
    console = Console(width=80, record=True, color_system=None)
    console.print(table(rows))
    text = console.export_text()
    shown = " ".join(text.split())  # the caption wraps at 80 columns
    assert "moved ±50%: the machine's load changed" in shown
    assert "6 of 6 latency figures are unreliable" in shown
    assert "original b1 unreliable (spread ±50%), original b32 unreliable (spread ±33%)" in shown
    assert "original 100% 120 KB 120 KB 1 ? 90 ? 0.9000" in shown  # figures with '?', no spread
    assert "120 KB" in shown and "21 KB" in shown and " MB" not in shown  # a small model in KB
    printed = [line.rstrip() for line in text.splitlines() if line.strip()]
    assert [line for line in printed if not OWN_LINE.fullmatch(line)] == []  # the caption, as the table's


def test_sizes_keep_three_figures_in_their_unit():
    assert [size_text(n) for n in (512, 40_181, 117_816, 1_234_567, 438_000_000, 7.2e9)] == [
        "512 B", "40.2 KB", "118 KB", "1.23 MB", "438 MB", "7.2 GB",
    ]  # fmt: skip
