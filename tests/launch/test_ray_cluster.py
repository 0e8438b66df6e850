"""gpuforge.launch.ray_cluster stands alone: the server reads a Ray cluster's devices through it without
importing the ranks' supervision, the actor that runs a rank, their placement, or Ray itself before a call.
Its calls on a real cluster are tested in test_ray_ranks.py and test_ray_placement.py."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after_importing(module: str, watched: list[str]) -> list[str]:
    """Which of ``watched`` a fresh interpreter holds once it imported ``module`` (this one has imported
    many things already)."""
    code = f"import sys, json, {module}\nprint(json.dumps([m for m in {watched!r} if m in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_device_inventory_imports_no_rank_supervision():
    supervision = [
        "gpuforge.launch.ray_ranks",
        "gpuforge.launch.ray_rank_actor",
        "gpuforge.launch.ray_placement",
        "ray",
    ]
    assert _modules_after_importing("gpuforge.launch.ray_cluster", supervision) == []
    # the check can fail: importing the supervising module does bring them in
    assert _modules_after_importing("gpuforge.launch.ray_ranks", supervision) == supervision[:3]
