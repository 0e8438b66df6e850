"""`gpuforge tune SPEC --local --out DIR`: a search on this machine, with no server.

Each trial runs as `gpuforge train` on its own spec and run directory, as a server would run it: what a
trial does is what a job does (checkpoints, resume, its summary). By default a warm worker process per slot
runs trial after trial, so that only the first pays the interpreter's start and the imports
(`--process-per-trial`: a fresh process each; trials.py). This process reads each trial's evaluations as
they are written, tells the study, and ends a pruned trial at once (no checkpoint: a pruned trial is not
resumed). The search's folder:

    DIR/search.yaml         the search as given (a rerun must give the same one)
    DIR/study.db            the Optuna study (SQLite): every trial, its values and figures
    DIR/state.json          the search's state: running, finished, budget_spent, stopped, paused
    DIR/trials/trial-0003.yaml, trial-0003/ (its run directory), trial-0003.log (its output)

Running the same command again goes on where the search was: trials that were running resume from their
checkpoints (gpuforge's resume), the study is not asked again for them. Ctrl-C (or SIGTERM) stops the
trials at a checkpoint and leaves the search `paused`; `gpuforge tune stop DIR` ends it (`stopped`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuforge.errors import GpuforgeError
from gpuforge.runs import read_summary, write_json_atomic
from gpuforge.runtime.host import is_alive, usable_cores
from gpuforge.search.study import SearchStudy
from gpuforge.search.trials import TrialPool, TrialProcess, signal_group
from gpuforge.spec import SearchSpec

STOP_FILE = "stop"  # `gpuforge tune stop DIR` writes it; the driver ends the search at its next look
NOTE_EVERY_S = 2.0  # a running trial's figures are noted in the study this often at most
POLL_S = 0.02  # how often the driver reads its trials' new lines: a pruned trial runs on this long at most
STOP_WAIT_S = 120.0  # a trial asked to stop has this long to save its checkpoint


def trial_name(number: int) -> str:
    return f"trial-{number:04d}"


@dataclass
class Spend:
    usd: float
    device_s: float


@dataclass
class RunningTrial:
    number: int
    process: TrialProcess
    run_dir: Path
    started: float  # time.monotonic() at its (re)start
    device_s_before: float  # device-seconds of earlier processes of this trial (before a resume)
    usd_per_device_s: float
    devices: int
    offset: int = 0  # how far its metrics.jsonl has been read
    noted: float = 0.0  # time.monotonic() of its last figures noted in the study
    last_step: int | None = None  # the last step its metrics told
    stopping: str | None = None  # why the driver asked it to stop (it then ends `stopped` or `paused`)
    stop_sent: float | None = None  # time.monotonic() of that SIGTERM
    pausing: bool = False  # stopped to wait at its rung for peers (tune.pruner.asha.pause)

    def device_s(self, now: float) -> float:
        return self.device_s_before + (now - self.started) * self.devices

    def cost(self, now: float) -> float:
        return self.device_s(now) * self.usd_per_device_s


@dataclass
class PausedTrial:
    """A trial stopped at a checkpoint at a rung too few trials had reached to judge it: judged again as
    trials reach that rung (study.judge_paused), then resumed or pruned."""

    number: int
    device_s: float
    usd: float
    steps: int | None


class LocalSearch:
    def __init__(self, search: SearchSpec, out: Path, parallel: int | None = None, announce=None,
                 process_per_trial: bool = False):  # fmt: skip
        self.search, self.out = search, Path(out)
        # warm workers for a job of one process; one of several processes launches its ranks per trial
        self.warm = not process_per_trial and search.job.distributed.strategy == "none"
        self.parallel = parallel or search.tune.parallel
        self.announce = announce or (lambda line: None)
        self.trials_dir = self.out / "trials"
        self.running: dict[int, RunningTrial] = {}
        self.paused: dict[int, PausedTrial] = {}
        self._judge_due = False  # something a paused trial's verdict reads changed since the last look
        asha = search.tune.pruner.asha
        self.pause_factor = asha.reduction_factor if asha is not None and asha.pause else None
        self._interrupted: str | None = None
        self.done = Spend(0.0, 0.0)  # what the ended trials cost (read from the study at the start)
        self.cheapest: tuple[float, float] | None = None  # the cheapest ended trial's dollars, device-s

    # --- the folder

    def _claim_folder(self) -> None:
        given = {"tune": self.search.tune.model_dump(mode="json", by_alias=True), "job": self.search.job_raw}
        path = self.out / "search.yaml"
        if path.exists():
            held = yaml.safe_load(path.read_text())
            if held != yaml.safe_load(yaml.safe_dump(given)):
                raise GpuforgeError(
                    f"{self.out}: holds another search (its search.yaml differs from this spec): "
                    "give another --out, or the same spec to go on with it"
                )
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(given, sort_keys=False))
        self.trials_dir.mkdir(exist_ok=True)
        (self.out / STOP_FILE).unlink(missing_ok=True)

    def _set_state(self, state: str, reason: str | None = None) -> None:
        write_json_atomic(self.out / "state.json", {"state": state, "reason": reason, "at": time.time()})

    # --- trials

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.parallel > 1:  # trials share the cores instead of each spinning on all of them
            env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // self.parallel))
        return env

    def _launch(self, number: int, params: dict[str, Any], device_s_before: float = 0.0) -> None:
        name = trial_name(number)
        spec_path, run_dir = self.trials_dir / f"{name}.yaml", self.trials_dir / name
        if not spec_path.exists():  # a resumed trial keeps the spec it started with
            spec = self.search.trial_spec(params, name=f"{self.search.job.name}-{name}")
            spec_path.write_text(spec.to_yaml())
        job = self.search.job  # devices and price are the job's: a search may not vary them (FIXED_KEYS)
        process = self.pool.start(number, spec_path, run_dir, self.trials_dir / f"{name}.log")
        self.running[number] = RunningTrial(
            number, process, run_dir, process.started, device_s_before,
            job.cost.usd_per_hour / 3600, job.resources.devices,
        )  # fmt: skip
        self.study.note(number, run=str(run_dir), pid=process.pid, pid_mark=process.pid_mark)

    def _read_evaluations(self, trial: RunningTrial) -> str | None:
        """Tell the study the trial's new evaluations; the reason to prune it, if one says so."""
        taken = self.study.take_evaluations(trial.number, trial.run_dir / "metrics.jsonl", trial.offset)
        moved = taken.offset != trial.offset
        self._judge_due |= moved
        trial.offset = taken.offset
        if taken.last_step is not None:
            trial.last_step = taken.last_step
        now = time.monotonic()
        if moved and taken.prune is None and now - trial.noted >= NOTE_EVERY_S:
            trial.noted = now  # what it has cost so far, for `tune show` while it runs (a few commits)
            self.study.note(trial.number, steps=trial.last_step, cost_usd=trial.cost(now),
                            device_s=trial.device_s(now))  # fmt: skip
        return taken.prune

    def _end(self, trial: RunningTrial, state: str, reason: str | None, value: float | None = None,
             steps: int | None = None) -> None:  # fmt: skip
        now = time.monotonic()
        del self.running[trial.number]
        self._close(trial.number, state, reason, value, steps, Spend(trial.cost(now), trial.device_s(now)))

    def _close(self, number: int, state: str, reason: str | None, value: float | None, steps: int | None,
               spent: Spend) -> None:  # fmt: skip
        self._judge_due = True  # a slot freed, a trial's end counted
        figures = {"steps": steps, "cost_usd": spent.usd, "device_s": spent.device_s}
        self.study.finish(number, state, value, reason, **figures)
        self.done = Spend(self.done.usd + spent.usd, self.done.device_s + spent.device_s)
        if state in ("finished", "pruned"):  # what a trial that reached an evaluation cost
            low = self.cheapest or (spent.usd, spent.device_s)
            self.cheapest = min(low[0], spent.usd), min(low[1], spent.device_s)
        shown = f"{self.study.metric} {value:.4g}" if value is not None else ""
        self.announce(f"{trial_name(number)} {state}" + (f": {reason}" if reason else f" {shown}"))

    def _prune(self, trial: RunningTrial, reason: str) -> None:
        trial.process.prune()
        self._end(trial, "pruned", reason, steps=trial.last_step)

    def _ended(self, trial: RunningTrial, code: int) -> None:
        """The trial's process ended by itself: its summary says how."""
        try:
            summary = read_summary(trial.run_dir / "summary.json")
        except ValueError:
            summary = None
        if summary is None and trial.stopping and self._interrupted:
            del self.running[trial.number]  # stopped before its first step: the next driver starts it again
            self.study.note(trial.number, pid=None)
        elif summary is None and trial.stopping:
            self._end(trial, "stopped", f"{trial.stopping} (before its first step)")  # stopped as it started
        elif summary is None:
            why = trial.process.error or f"its process ended with code {code} and wrote no summary"
            self._end(trial, "failed", why)
        elif trial.pausing and summary.status in ("cancelled", "paused") and not self._interrupted:
            now = time.monotonic()
            paused = PausedTrial(trial.number, trial.device_s(now), trial.cost(now), summary.steps)
            self.paused[trial.number] = paused
            self._judge_due = True
            del self.running[trial.number]
            self.study.note(trial.number, steps=paused.steps, cost_usd=paused.usd, device_s=paused.device_s,
                            pid=None)  # fmt: skip
        elif summary.status == "finished":
            value = self.study.final_value(trial.number, trial.run_dir)
            self._end(trial, "finished", summary.reason, value, summary.steps)
        elif summary.status in ("cancelled", "paused") and trial.stopping:
            if self._interrupted:  # Ctrl-C: left running in the study, resumed by the next driver
                del self.running[trial.number]
                self.study.note(trial.number, device_s=trial.device_s(time.monotonic()), pid=None)
            else:
                value = self.study.final_value(trial.number, trial.run_dir)
                self._end(trial, "stopped", trial.stopping, value, steps=summary.steps)
        else:
            self._end(trial, "failed", summary.reason or f"ended {summary.status}", steps=summary.steps)

    # --- pausing at a rung (tune.pruner.asha.pause)

    def _may_pause(self, trial: RunningTrial) -> bool:
        """Whether a trial ASHA would prune now may wait instead: too few trials have reached its rung to
        judge it, and a new trial can take its place meanwhile."""
        if self.pause_factor is None:
            return False
        standing = self.study.rung_standing(trial.number)
        if standing is None or len(standing[2]) >= self.pause_factor:
            return False
        return self._trials_to_come() > 0

    def _pause(self, trial: RunningTrial) -> None:
        trial.stopping, trial.stop_sent, trial.pausing = "paused at its rung", time.monotonic(), True
        trial.process.stop()
        self.study.note(trial.number, paused=True)
        self.announce(f"{trial_name(trial.number)} pauses at step {trial.last_step}: too few trials have "
                      "reached its rung to judge it")  # fmt: skip

    def _judge_paused(self) -> None:
        """Each paused trial, against the trials at its rung now: one among the best resumes (ahead of new
        trials, as a slot frees); one that the trials still to come could not lift among them is pruned;
        the others wait."""
        if not (self.paused and self._judge_due):  # its verdicts read the study: only when they may change
            return
        self._judge_due = False
        may_come = self._trials_to_come()
        for number in sorted(self.paused):
            verdict = self.study.judge_paused(number, may_come)
            paused = self.paused[number]
            if verdict == "resume" and len(self.running) < self.parallel:
                del self.paused[number]
                self.study.note(number, paused=False)
                self._launch(number, {}, paused.device_s)
                self.announce(f"{trial_name(number)} resumes: among the best at its rung")
            elif verdict not in ("resume", "wait"):
                del self.paused[number]
                self._close(number, "pruned", f"after a pause: {verdict}", None, paused.steps,
                            Spend(paused.usd, paused.device_s))  # fmt: skip

    def _trials_to_come(self) -> int:
        if not self._room_for_a_trial():
            return 0
        return max(0, self.search.tune.max_trials - self.asked)

    def _stop_paused(self, why: str) -> None:
        for number, paused in list(self.paused.items()):
            del self.paused[number]
            value = self.study.final_value(number, self.trials_dir / trial_name(number))
            self._close(number, "stopped", why, value, paused.steps, Spend(paused.usd, paused.device_s))

    # --- the search's spend, and its end

    def spend(self) -> Spend:
        """The ended trials' spend (kept as they end), the paused ones' and the running ones' so far."""
        now = time.monotonic()
        usd = self.done.usd + sum(t.cost(now) for t in self.running.values())
        device_s = self.done.device_s + sum(t.device_s(now) for t in self.running.values())
        usd += sum(p.usd for p in self.paused.values())
        device_s += sum(p.device_s for p in self.paused.values())
        return Spend(usd, device_s)

    def _budget_reason(self) -> str | None:
        spent = self.spend()
        return self.search.tune.budget.spent(spent.usd, spent.device_s)

    def _room_for_a_trial(self) -> bool:
        spent = self.spend()
        return self.search.tune.budget.pays_for(spent.usd, spent.device_s, self.cheapest)

    def _stop_all(self, why: str) -> None:
        for trial in self.running.values():
            if trial.stopping is None:
                trial.stopping, trial.stop_sent = why, time.monotonic()
                trial.process.stop()

    def _kill_stragglers(self) -> None:
        """A trial asked to stop that has not within STOP_WAIT_S (no checkpoint coming): killed."""
        for trial in self.running.values():
            if trial.stop_sent is not None and time.monotonic() - trial.stop_sent > STOP_WAIT_S:
                trial.process.kill()

    # --- the loop

    def _adopt_running(self) -> None:
        """Trials the study still holds as running: a driver that stopped left them. Each resumes from its
        checkpoint, once the process the last driver started (if it lives) has ended."""
        for frozen in self.study.running():
            attrs = frozen.user_attrs
            pid = attrs.get("pid")
            mark = attrs.get("pid_mark") or str(self.trials_dir / trial_name(frozen.number))
            deadline = time.monotonic() + STOP_WAIT_S
            while is_alive(pid, mark) and time.monotonic() < deadline:
                time.sleep(POLL_S)  # it got SIGTERM with its driver: let it save its checkpoint
            if is_alive(pid, mark):  # no checkpoint coming: never two processes on one run
                signal_group(pid, signal.SIGKILL)
                while is_alive(pid, mark):
                    time.sleep(POLL_S)
            if attrs.get("paused"):  # it waits at its rung, as it did
                self.paused[frozen.number] = PausedTrial(
                    frozen.number, float(attrs.get("device_s") or 0.0), float(attrs.get("cost_usd") or 0.0),
                    attrs.get("steps"),
                )  # fmt: skip
                continue
            self.announce(f"{trial_name(frozen.number)} resumes")
            try:
                self._launch(frozen.number, dict(frozen.params), float(attrs.get("device_s") or 0.0))
            except GpuforgeError as err:
                self.study.finish(frozen.number, "failed", reason=f"its spec: {err}"[:1000])

    def run(self) -> str:
        """Run the search to its end (or Ctrl-C); the search's final state."""
        self._claim_folder()
        self.study = SearchStudy(self.search, f"sqlite:///{self.out.resolve() / 'study.db'}", "search")
        self._set_state("running")
        self.asked = len(self.study.study.get_trials(deepcopy=False))  # counted here on, not read each look
        ended = [t for t in self.study.trials() if t.state != "running"]
        self.done = Spend(sum(t.cost_usd for t in ended), sum(t.device_s for t in ended))
        judged = [t for t in ended if t.state in ("finished", "pruned")]
        if judged:
            self.cheapest = min(t.cost_usd for t in judged), min(t.device_s for t in judged)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.pool = TrialPool(self.trials_dir, self._child_env(), self.warm)
        try:
            self._adopt_running()
            state, reason = self._loop()
        finally:
            self.pool.close(STOP_WAIT_S)
            for s, handler in previous.items():
                signal.signal(s, handler)
        self._set_state(state, reason)
        return state

    def _on_signal(self, signum, frame) -> None:
        self._interrupted = signal.Signals(signum).name

    def _loop(self) -> tuple[str, str | None]:
        ending: tuple[str, str] | None = None
        while True:
            for trial in list(self.running.values()):
                reason = self._read_evaluations(trial)
                if reason is not None and trial.stopping is None:
                    if not self._may_pause(trial):
                        self._prune(trial, reason)
                        continue
                    self._pause(trial)
                code = trial.process.poll()
                if code is not None:
                    self._read_evaluations(trial)  # the lines written after the last look
                    self._ended(trial, code)
            if ending is None:
                if self._interrupted:
                    ending = ("paused", f"interrupted ({self._interrupted}): the same command goes on")
                elif (self.out / STOP_FILE).exists():
                    ending = ("stopped", "stopped by `gpuforge tune stop`")
                elif (why := self._budget_reason()) is not None:
                    ending = ("budget_spent", why)
                if ending is not None:
                    self.announce(f"search {ending[0]}: {ending[1]}")
                    self._stop_all(ending[1])
            self._kill_stragglers()
            if ending is None:
                self.pool.trim(self.parallel)  # a pruned trial's worker may have been replaced meanwhile
                self._judge_paused()
                self._start_trials()
            if ending is None and not self.running and not self._room_for_a_trial() and self._trials_left():
                spent, (usd, device_s) = self.spend(), self.cheapest
                ending = ("budget_spent", (
                    f"what is left of its budget pays for no trial (spent ${spent.usd:.4f}, "
                    f"{spent.device_s / 3600:.4f} device-hours; the cheapest trial so far: ${usd:.4f}, "
                    f"{device_s:.1f} device-s)"
                ))  # fmt: skip
                self.announce(f"search {ending[0]}: {ending[1]}")
            if not self.running and (ending is not None or not self.paused):
                if ending is not None and not self._interrupted:  # Ctrl-C: they wait for the next driver
                    self._stop_paused(ending[1])
                return ending or ("finished", None)
            time.sleep(POLL_S)

    def _trials_left(self) -> bool:
        return self.asked < self.search.tune.max_trials

    def _start_trials(self) -> None:
        while len(self.running) < self.parallel and self.asked < self.search.tune.max_trials:
            if not self._room_for_a_trial():
                return
            number, params = self.study.ask()
            self.asked += 1
            self._judge_due = True
            shown = ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
            )
            try:
                self._launch(number, params)
            except GpuforgeError as err:  # values that break a rule between keys: this trial alone fails
                self.study.finish(number, "failed", reason=f"its spec: {err}"[:1000])
                self.announce(f"{trial_name(number)} failed: its spec: {err}")
                continue
            self.announce(f"{trial_name(number)} starts: {shown}")


def read_state(out: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(out) / "state.json").read_text())
    except (OSError, ValueError):
        return {"state": "unknown", "reason": None}


def open_search(out: Path) -> tuple[SearchSpec, SearchStudy]:
    """A local search's folder, to read (`tune show`): its spec as it was given, and its study."""
    import copy

    from gpuforge.spec import JobSpec, check_search, parse_spec, parse_tune

    out = Path(out)
    path = out / "search.yaml"
    if not path.is_file() or not (out / "study.db").is_file():
        raise GpuforgeError(f"{out}: not a search's folder (no search.yaml and study.db in it)")
    held = yaml.safe_load(path.read_text())
    tune = parse_tune(held["tune"], str(path))
    job = parse_spec(copy.deepcopy(held["job"]), out.resolve(), origin=str(path))
    assert isinstance(job, JobSpec)
    search = check_search(tune, job, held["job"])
    return search, SearchStudy(search, f"sqlite:///{out.resolve() / 'study.db'}", "search")


def request_stop(out: Path) -> None:
    open_search(out)  # refuses a folder that is not a search's
    (Path(out) / STOP_FILE).write_text("stop\n")
