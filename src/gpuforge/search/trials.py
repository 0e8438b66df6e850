"""How a local search runs its trials' processes: the driver (local.py) sees one handle per running trial,
whichever way it runs.

- Warm (the default for a job of one process): a worker process per slot (cli/trial_worker.py) imports
  torch and the model's libraries once and runs trial after trial, each exactly as `gpuforge train` would.
  A trial's start then costs its own set-up (data, model, first step), not the interpreter's and the
  imports' seconds again. The worker's own start is charged to the first trial it runs.
- Cold (`--process-per-trial`, and a job of several processes): `gpuforge train` in a process per trial;
  nothing a trial's code leaves behind (a model file's globals, threads) can reach the next.

Either handle: poll() (None while it runs, else an exit code), stop() (SIGTERM: a checkpoint, then its
end), prune() (at once, no checkpoint), kill(); `pid` and `pid_mark` let a restarted driver wait for a
process the last driver left (runtime.host.is_alive).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

PRUNE_WAIT_S = 30.0  # a worker that has not dropped a pruned trial by then is killed (and replaced)
DROP_WAIT_S = 5.0  # a new trial waits this long for a worker dropping a pruned trial before starting one


def signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def die_with_parent() -> None:
    """In the trial's process before exec: SIGTERM when the driver dies (even by kill -9), so that a trial
    never runs on unwatched; it saves a checkpoint, and the next driver resumes it."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: Ctrl-C and `tune stop` still stop trials


class TrialProcess(Protocol):
    pid: int
    pid_mark: str  # an argument of its command line, for runtime.host.is_alive
    started: float  # time.monotonic() from which the trial is charged
    error: str | None  # what ended it, when its process said (a warm trial's exception)

    def poll(self) -> int | None: ...
    def stop(self) -> None: ...
    def prune(self) -> None: ...
    def kill(self) -> None: ...


class ColdTrial:
    """`gpuforge train SPEC --out DIR` in a process of its own."""

    error = None

    def __init__(self, spec: Path, run_dir: Path, log: Path, env: dict[str, str]):
        self.started = time.monotonic()
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpuforge", "train", str(spec), "--out", str(run_dir)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                preexec_fn=die_with_parent,
            )  # fmt: skip
        self.pid, self.pid_mark = self.process.pid, str(run_dir)

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        signal_group(self.pid, signal.SIGTERM)

    def prune(self) -> None:
        self.kill()
        self.process.wait()

    def kill(self) -> None:
        signal_group(self.pid, signal.SIGKILL)


class Worker:
    """A warm process (cli/trial_worker.py): orders on its stdin, one answer line per trial on a pipe."""

    def __init__(self, trials_dir: Path, env: dict[str, str]):
        self.spawned = time.monotonic()
        read_end, write_end = os.pipe()
        with open(trials_dir / "worker.log", "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpuforge.cli.trial_worker", str(write_end), str(trials_dir)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                pass_fds=(write_end,), preexec_fn=die_with_parent,
            )  # fmt: skip
        os.close(write_end)
        os.set_blocking(read_end, False)
        self.answers_fd, self.pending = read_end, b""
        self.answers: dict[int, dict[str, Any]] = {}
        self.trial: int | None = None  # the trial it runs (or drops, when pruned)
        self.first = True  # its first trial pays its start
        self.pruned_at: float | None = None
        self.dropped: set[int] = set()  # pruned trials: their answers are read and thrown away

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def idle(self) -> bool:
        self.read()
        return self.trial is None and not self.answers and self.alive()  # every answer taken by its trial

    def give(self, number: int, spec: Path, run_dir: Path, log: Path) -> None:
        order = {"number": number, "spec": str(spec), "out": str(run_dir), "log": str(log)}
        self.process.stdin.write((json.dumps(order) + "\n").encode())
        self.process.stdin.flush()
        self.trial, self.pruned_at = number, None

    def read(self) -> None:
        if self.answers_fd < 0:
            return  # closed: what it had written was read then
        while True:
            try:
                chunk = os.read(self.answers_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            try:  # the trial's own code runs in the worker and could write here: a stray line is skipped
                answer = json.loads(line)
                answer["number"], answer["code"] = int(answer["number"]), int(answer["code"])
            except (ValueError, TypeError, KeyError, OverflowError):
                continue
            if answer.get("error") is not None:
                answer["error"] = str(answer["error"])[:1000]
            if answer["number"] == self.trial:
                self.trial = None
            if answer["number"] not in self.dropped:
                self.answers[answer["number"]] = answer
        if self.pruned_at is not None and self.trial is not None:
            if time.monotonic() - self.pruned_at > PRUNE_WAIT_S:
                self.kill()
            else:  # again at each look: one sent while the trial was still setting up was ignored
                self.signal(signal.SIGUSR1)

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        signal_group(self.pid, signal.SIGKILL)
        self.process.wait()

    def close(self) -> None:
        """No more orders: it ends once its trial has (a trial asked to stop saves its checkpoint)."""
        if self.answers_fd < 0:
            return
        self.read()  # answers written before it ended stay for their trials
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        os.close(self.answers_fd)
        self.answers_fd = -1


class WarmTrial:
    """A trial in a worker."""

    def __init__(self, worker: Worker, number: int):
        self.worker, self.number = worker, number
        self.started = worker.spawned if worker.first else time.monotonic()
        worker.first = False
        self.pid, self.pid_mark = worker.pid, str(Path(worker.process.args[-1]))
        self.error: str | None = None

    def poll(self) -> int | None:
        code = self.worker.process.poll()  # first: an answer written just before it died is read below
        self.worker.read()
        answer = self.worker.answers.pop(self.number, None)
        if answer is not None:
            self.error = answer.get("error")
            return answer["code"]
        if code is not None:
            self.error = f"its worker process ended with code {code}"
            return code or 1
        return None

    def stop(self) -> None:
        signal_group(self.pid, signal.SIGTERM)

    def prune(self) -> None:
        """SIGUSR1: the worker drops the trial at once and takes the next one; the driver does not wait."""
        self.worker.dropped.add(self.number)
        self.worker.answers.pop(self.number, None)
        if self.worker.trial == self.number:
            self.worker.pruned_at = time.monotonic()
            self.worker.signal(signal.SIGUSR1)

    def kill(self) -> None:
        self.worker.kill()


class TrialPool:
    """The driver's trial processes: at most `slots` at once, warm workers kept between trials."""

    def __init__(self, trials_dir: Path, env: dict[str, str], warm: bool):
        self.trials_dir, self.env, self.warm = trials_dir, env, warm
        self.workers: list[Worker] = []

    def start(self, number: int, spec: Path, run_dir: Path, log: Path) -> TrialProcess:
        if not self.warm:
            return ColdTrial(spec, run_dir, log, self.env)
        self._forget_dead()
        worker = self._idle_worker()
        try:
            if worker is None:
                raise BrokenPipeError
            worker.give(number, spec, run_dir, log)
        except BrokenPipeError:  # none idle, or the idle one just ended: a new one
            worker = Worker(self.trials_dir, self.env)
            self.workers.append(worker)
            worker.give(number, spec, run_dir, log)
        return WarmTrial(worker, number)

    def _idle_worker(self) -> Worker | None:
        """An idle worker; else one dropping a pruned trial, once it has (a step at most, most often),
        rather than a new worker paying the start again."""
        deadline = time.monotonic() + DROP_WAIT_S
        while True:
            worker = next((w for w in self.workers if w.idle()), None)
            dropping = [w for w in self.workers if w.pruned_at is not None and w.trial is not None]
            if worker is not None or not dropping or time.monotonic() > deadline:
                return worker
            time.sleep(0.01)

    def _forget_dead(self) -> None:
        for worker in self.workers:
            if not worker.alive():
                worker.close()
        self.workers = [w for w in self.workers if w.alive()]

    def trim(self, slots: int) -> None:
        """Workers beyond `slots` that sit idle (a pruned trial's worker still dropping it is busy) end."""
        self._forget_dead()
        idle = [w for w in self.workers if w.idle()]
        while len(self.workers) > slots and idle:
            worker = idle.pop()
            worker.close()
            self.workers.remove(worker)

    def close(self, wait_s: float) -> None:
        """Every worker told to end, a busy one's trial stopped at a checkpoint (the driver may be ending
        on an error); each has `wait_s`, then is killed."""
        for worker in self.workers:
            if worker.alive() and not worker.idle():
                signal_group(worker.pid, signal.SIGTERM)
            worker.close()
        deadline = time.monotonic() + wait_s
        for worker in self.workers:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill()
        self.workers = []
