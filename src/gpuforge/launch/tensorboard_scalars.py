"""A script job's TensorBoard scalars, read into its metrics as they appear: a script that already writes
event files to $GPUFORGE_RUN_DIR/tensorboard needs no gpuforge.track to show its curves.

Both kinds of scalar are read:
- simple values, as torch.utils.tensorboard and TF1 write them;
- rank-0 tensors, as TF2's tf.summary.scalar writes them.

Each new (step, tag) pair becomes part of one metrics line per step, {"step", "<tag>": value, "source":
"tensorboard"}, with tags' slashes kept ("train/loss"). Reading needs the `tensorboard` package (the
tracking extra); without it, one line in the log says so and nothing else changes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpuforge.runs import RunDir

POLL_S = 1.0


class ScalarReader:
    """Polls <run>/tensorboard on a thread of its own until stop(); what it read last is flushed then."""

    def __init__(self, run: RunDir, log: Path, from_step: int = 0):
        self.run, self.log = run, log
        self.from_step = from_step  # steps before it are in metrics.jsonl already (an earlier attempt's)
        self.folder = run.root / "tensorboard"
        self.seen: dict[str, int] = {}  # tag -> last step written
        self._accumulators: dict[Path, object] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> ScalarReader:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.read_new(final=True)  # the last events the script wrote before it ended

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.read_new()

    def read_new(self, final: bool = False) -> int:
        """Write the scalars that appeared since the last read; how many steps got a line. The newest step
        waits for the next read (its other tags may still be on their way), but for the final one."""
        try:
            from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        except ImportError:
            if self.folder.is_dir() and not self.seen.get("\0warned"):
                self.seen["\0warned"] = 1
                with open(self.log, "a") as f:
                    f.write("gpuforge: tensorboard is not installed: event files are not read into metrics\n")
            return 0
        by_step: dict[int, dict[str, float]] = {}
        for path in sorted({p.parent for p in self.folder.rglob("events.out.tfevents.*")}):
            accumulator = self._accumulators.get(path)
            if accumulator is None:
                accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
                self._accumulators[path] = accumulator
            try:
                accumulator.Reload()  # reads what was appended since the last call
            except Exception:  # noqa: BLE001 (a file cut mid-record by a kill: read again next time)
                continue
            for tag, step, value in _scalars(accumulator):
                if step >= self.from_step and step > self.seen.get(tag, -1):
                    by_step.setdefault(step, {})[tag] = value
        steps = sorted(by_step) if final else sorted(by_step)[:-1]
        for step in steps:
            for tag in by_step[step]:
                self.seen[tag] = max(self.seen.get(tag, -1), step)
            self.run.metric({"ts": time.time(), "step": step, **by_step[step], "source": "tensorboard"})
        return len(steps)


def _scalars(accumulator) -> list[tuple[str, int, float]]:
    found = []
    tags = accumulator.Tags()
    for tag in tags.get("scalars", []):
        found += [(tag, e.step, float(e.value)) for e in accumulator.Scalars(tag)]
    for tag in tags.get("tensors", []):
        from tensorboard.util import tensor_util

        for e in accumulator.Tensors(tag):
            array = tensor_util.make_ndarray(e.tensor_proto)
            if array.size == 1 and array.dtype.kind in "fiu":
                found.append((tag, e.step, float(array.item())))
    return found
