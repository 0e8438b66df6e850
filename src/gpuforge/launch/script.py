"""Run a script job: the team's own command, in its working copy, with the devices, run directory, cost,
budget and stop signals a spec job gets, but not gpuforge's engine.

    gpuforge train keras.yaml --out runs/keras      # kind: script

The command runs without a shell (its words split like a shell's), in the spec's folder. A leading
`python` is the interpreter gpuforge runs under, or `script.python`. The process gets:
- its devices (CUDA_VISIBLE_DEVICES, or a CPU slot's threads);
- GPUFORGE_RUN_DIR, where gpuforge.track writes metrics and checkpoints (and TensorBoard event files
  under <run>/tensorboard are read into the metrics: tensorboard_scalars.py);
- the allow-listed environment (child_env.py) and the spec's `script.env`.

Its output goes to <run>/logs/script.log and to this terminal.

Stopping: SIGTERM or Ctrl-C here, a spent cost.budget_usd, or resources.max_time passed. gpuforge then
writes <run>/stop and sends the script SIGTERM (gpuforge.track turns it into should_stop()), waits
script.stop_grace_s, then sends SIGKILL. A script that checkpointed (track.checkpointed) resumes from there
when the same command runs again on the same run directory; one that did not starts from the beginning.
The `started` event says which.

Crashes: a script killed by a signal gpuforge did not send (the OOM killer's SIGKILL, a segfault; under
torchrun, a rank's) is started again, up to script.max_restarts times, as a spec job's dead rank is; each
`restarted` event says whether it resumes from a checkpoint. An exit with a code of its own is the
script's answer (a bug, bad data): it fails at once, with the end of its log as the reason.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuforge import track
from gpuforge.child_env import child_environment
from gpuforge.errors import GpuforgeError, SpecError
from gpuforge.launch.tensorboard_scalars import ScalarReader
from gpuforge.runs import RunDir, RunSummary, read_jsonl
from gpuforge.runtime.host import usable_cores
from gpuforge.spec import ScriptJobSpec, parse_duration, working_copy_files
from gpuforge.train.resume import check_same_job

LOG_NAME = "script.log"
FAILURE_LINES = 5  # of the log's end, in a failed run's reason
POLL_S = 0.2


@dataclass
class _Running:
    """The command's process and, under torchrun, its ranks. torchrun starts each rank in a session of its
    own, out of reach of a signal to the command's group: the ranks are found (children of torchrun) while
    it runs, so that a stop reaches them and none outlives the job. A rank is known by its pid and start
    time, so that a pid the system gave to another process since is never signalled."""

    process: subprocess.Popen
    torchrun: bool
    ranks: dict[int, int] = field(default_factory=dict)  # pid -> start time (clock ticks since boot)
    stopped: set[int] = field(default_factory=set)  # ranks sent SIGTERM already
    looked_at: float = 0.0

    def find_ranks(self, every_s: float = 1.0) -> None:
        if not self.torchrun or time.monotonic() - self.looked_at < every_s:
            return
        self.looked_at = time.monotonic()
        for pid in _children(self.process.pid):
            if pid not in self.ranks and (started := _start_time(pid)) is not None:
                self.ranks[pid] = started
        self.ranks = {pid: t for pid, t in self.ranks.items() if _start_time(pid) == t}  # the live ones

    def groups(self) -> list[int]:
        return [self.process.pid, *sorted(self.ranks)]

    def signal(self, signum: int, groups: list[int] | None = None) -> None:
        """`signum` to each process group (the command's, and each rank's with what it started)."""
        for pgid in self.groups() if groups is None else groups:
            if pgid in self.ranks and _start_time(pgid) != self.ranks[pgid]:
                continue  # that rank is gone, and its pid may be another process's now
            try:
                os.killpg(pgid, signum)
            except (ProcessLookupError, PermissionError):
                pass


@dataclass
class _Stop:
    """Why the script is being stopped, and the status that makes: first reason wins."""

    reason: str | None = None
    status: str = "cancelled"
    signal: int | None = None
    at: float | None = None
    running: _Running | None = None  # the attempt running now, which a second signal kills
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, reason: str, status: str, signum: int | None = None) -> bool:
        with self.lock:
            if self.reason is not None:
                return False
            self.reason, self.status, self.signal, self.at = reason, status, signum, time.monotonic()
            return True


def run_script(spec: ScriptJobSpec, out: Path) -> RunSummary:
    """Run the script job into `out`, until it ends or is stopped; its summary (also in summary.json)."""
    out = Path(out).resolve()  # the script runs elsewhere (its working copy): a relative path would move
    run = RunDir(out)
    run.check_usable()
    run.create()
    workdir = working_copy(spec, out)
    argv = command_line(spec, workdir)
    check_same_job(run, spec)  # resuming is for the same job only
    spent_before = _spent(run)
    if spec.cost.budget_usd and spent_before >= spec.cost.budget_usd:
        raise GpuforgeError(
            f"cost.budget_usd: {spec.cost.budget_usd:g} spent already (${spent_before:.4f} so far): "
            f"{budget_hint(spent_before)}"
        )
    run.spec_path.write_text(spec.to_yaml())
    (run.root / track.STOP_FILE).unlink(missing_ok=True)  # an earlier attempt's stop is not this one's
    unbuffered = {} if "PYTHONUNBUFFERED" in spec.script.env else {"PYTHONUNBUFFERED": "1"}  # live output
    given = {**unbuffered, **spec.script.env, **_device_env(spec), track.RUN_DIR_VARIABLE: str(run.root)}
    if (job_id := track.job_id()) is not None:  # a server's job: track.job_id() in the script too
        given[track.JOB_ID_VARIABLE] = str(job_id)
    env = child_environment(given)
    log_path = run.logs_dir / LOG_NAME
    started = time.monotonic()
    usd_per_hour = spec.cost.usd_per_hour * spec.resources.devices
    stop = _Stop()
    restarts, crash, code, failure = 0, None, None, None
    previous = _forward_signals(stop)
    try:
        while True:
            resume = track.resume_step(run.root)
            run.truncate_metrics_after(resume - 1)  # logged past the last checkpoint: logged again
            how = "resumes from its checkpoint" if resume else "starts from the beginning"
            if crash is None:
                run.event("started", kind="script", command=argv, resumes_from=resume, how=how)
            else:
                run.event("restarted", attempt=restarts, max_restarts=spec.script.max_restarts,
                          reason=crash, resumes_from=resume, how=how)  # fmt: skip
                print(
                    f"gpuforge: {crash}; restart {restarts} of {spec.script.max_restarts}: {how}", flush=True
                )
            log_start = log_path.stat().st_size if log_path.exists() else 0  # this attempt's part of the log
            try:
                code = _attempt(
                    spec, argv, workdir, env, run, stop, started, spent_before, usd_per_hour, resume
                )
            except GpuforgeError as err:
                if crash is None:
                    raise  # the first attempt: the command cannot start at all (bad input)
                failure = f"{crash}; restart {restarts} could not start: {err}"  # after an OOM, say
                break
            crash = _crash(spec, code, stop, log_path, log_start)
            if crash is None or restarts >= spec.script.max_restarts:
                break
            _check_limits(spec, stop, started, spent_before, usd_per_hour)  # spent meanwhile: no restart
            if stop.reason is not None:  # asked to stop between two attempts
                break
            restarts += 1
    finally:
        _restore_signals(previous)
    wall = time.monotonic() - started
    stopped = failure is None and _stopped(spec, code, stop, log_path, log_start)
    summary = _summary(spec, run, code, stopped, stop, wall, usd_per_hour, resume, spent_before, log_start)
    if failure is not None:
        summary.status, summary.reason = "failed", failure
    elif summary.status == "failed" and crash is not None:  # the restarts are used up
        tail = summary.reason.partition(": ")[2]
        summary.reason = (
            f"{crash}, after {restarts} restart(s) (script.max_restarts {spec.script.max_restarts}): {tail}"
        )
    run.write_summary(summary)
    fields = {"reason": summary.reason} if summary.reason else {}
    run.event(summary.status, exit_code=code, **fields)
    return summary


def budget_hint(spent: float) -> str:
    """How to go on with a job its cost budget paused: on a server, `gpuforge resume` with a higher
    budget (the server keeps the spec); run by hand, a higher cost.budget_usd and the same command."""
    job_id = track.job_id()
    if job_id is None:
        return "raise cost.budget_usd and rerun to go on"
    return f"`gpuforge resume {job_id} --budget USD` (more than ${spent:.4f}) goes on from its checkpoint"


def _check_limits(spec: ScriptJobSpec, stop: _Stop, started: float, spent_before: float, usd_per_hour: float):
    """A stop request for a spent cost.budget_usd or a passed resources.max_time."""
    elapsed = time.monotonic() - started
    if spec.cost.budget_usd and spent_before + elapsed / 3600 * usd_per_hour >= spec.cost.budget_usd:
        stop.request(f"cost.budget_usd {spec.cost.budget_usd:g} spent", "paused")
    if spec.resources.max_time and elapsed >= parse_duration(spec.resources.max_time):
        stop.request(f"resources.max_time {spec.resources.max_time} passed", "paused")


def _attempt(
    spec, argv, workdir, env, run: RunDir, stop: _Stop, started, spent_before, usd_per_hour, resume
) -> int:
    """Run the command once, until it ends or is stopped (budget, max_time, a signal here): its exit code."""
    die_with_parent = _parent_death_signal()  # resolved here: nothing is imported between fork and exec
    try:
        process = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own: a stop reaches what it started too
            preexec_fn=die_with_parent,
        )
    except OSError as err:  # found by which() but not runnable (permissions, a bad interpreter line)
        raise GpuforgeError(f"script.command: cannot start {argv[0]}: {err.strerror}") from None
    running = stop.running = _Running(process, spec.script.launcher == "torchrun")
    copier = threading.Thread(target=_copy_output, args=(process, run.logs_dir / LOG_NAME), daemon=True)
    copier.start()
    scalars = ScalarReader(run, run.logs_dir / LOG_NAME, from_step=resume).start()
    try:
        while process.poll() is None:
            running.find_ranks()
            _check_limits(spec, stop, started, spent_before, usd_per_hour)
            if stop.at is not None:
                _stop_process(running, run, stop, spec.script.stop_grace_s)
            time.sleep(POLL_S)
    finally:
        _end_group(running)  # what the script started and left (ranks, workers, a child holding the pipe)
        stop.running = None  # a second signal from now on has nothing of this attempt's to kill
        copier.join(timeout=5)
        scalars.stop()
    return process.returncode


# torchrun's report of a rank that a signal ended ("exitcode  : -9 (pid: 123)"): its own exit code is 1
_RANK_SIGNALLED = re.compile(r"exitcode\s*:\s*-(\d+)")


def _crash(spec: ScriptJobSpec, code: int, stop: _Stop, log_path: Path, log_start: int) -> str | None:
    """How the attempt crashed, when a signal gpuforge did not send ended it (worth a restart), else None."""
    if stop.reason is not None or code == 0:
        return None
    if code < 0:
        return f"the script was killed by {_signal_name(-code)}"
    if spec.script.launcher == "torchrun":
        # torchrun ends the ranks left with SIGTERM once one fails: those are not the crash
        crashed = [s for s in rank_signals(_log_part(log_path, log_start)) if s != signal.SIGTERM]
        if crashed:
            return f"a rank was killed by {_signal_name(crashed[0])}"
    return None


def _stopped(spec: ScriptJobSpec, code: int, stop: _Stop, log_path: Path, log_start: int) -> bool:
    """Whether the attempt ended as it was asked to: saved and exited, or killed by our stop signals
    (under torchrun, ranks killed by them make torchrun exit 1)."""
    if stop.reason is None:
        return False
    if code in STOPPED_CODES:
        return True
    if spec.script.launcher != "torchrun":
        return False
    signals = rank_signals(_log_part(log_path, log_start))
    return bool(signals) and set(signals) <= {signal.SIGTERM, signal.SIGKILL}


def rank_signals(report: str) -> list[int]:
    """The signals that ended ranks, in the order torchrun's failure report lists them ("exitcode  : -9
    (pid: 123)"). Not its root cause alone: it picks the earliest failure by whole seconds, so a rank that
    exited on its peer's death may stand there instead of the peer that was killed."""
    return [int(n) for n in _RANK_SIGNALLED.findall(report)]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def working_copy(spec: ScriptJobSpec, out: Path) -> Path:
    """The folder the command runs in: the spec's, or for a job the server queued, the copy it made of
    the files sent beside the run directory (<run>.work)."""
    return Path(spec.script.workdir) if spec.script.workdir else Path(f"{out}.work")


def command_line(spec: ScriptJobSpec, workdir: Path) -> list[str]:
    """The argv to run: checked to exist (the command, the files), with `python` made an interpreter."""
    try:
        argv = shlex.split(spec.script.command)
    except ValueError as err:
        raise SpecError(f"script.command: {err}") from None
    if not argv:
        raise SpecError("script.command: empty")
    if not workdir.is_dir():
        raise SpecError(f"script.workdir: {workdir}: no such folder")
    working_copy_files(spec.script, workdir)  # each file there, none outside
    if argv[0] == "python":
        argv[0] = spec.script.python or sys.executable
    found = shutil.which(argv[0], path=os.environ.get("PATH")) if os.sep not in argv[0] else None
    if found is None:
        candidate = Path(argv[0]) if Path(argv[0]).is_absolute() else workdir / argv[0]
        if not (candidate.is_file() and os.access(candidate, os.X_OK)):
            raise SpecError(f"script.command: {argv[0]!r} not found (on PATH or in {workdir})")
        found = str(candidate)
    argv[0] = found
    if spec.script.launcher == "torchrun":
        argv = _torchrun(argv, spec)
    return argv


def _torchrun(argv: list[str], spec: ScriptJobSpec) -> list[str]:
    """One process a device through torch's launcher; the script must be Python."""
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    if not script.endswith(".py") or "python" not in Path(argv[0]).name:
        raise SpecError(
            "script.launcher: torchrun starts a Python script (`python train.py ...`), "
            f"not {shlex.join(argv[:2])!r}"
        )
    if spec.script.python:  # each rank starts as `python -m gpuforge.track`: that environment needs it
        _check_rank_client(spec.script.python)
    launcher = [
        argv[0],
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={spec.resources.devices}",
    ]
    # each rank through gpuforge.track, which has it die with torchrun (see _run_as_rank there)
    return launcher + ["-m", "gpuforge.track", *argv[argv.index(script) :]]


def _check_rank_client(python: str) -> None:
    probe = [python, "-c", "import gpuforge.track as t; t._run_as_rank"]
    try:
        found = subprocess.run(probe, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        raise SpecError(
            f"script.python: {python} has no gpuforge.track able to start torchrun's ranks: install this "
            "gpuforge there (pip install --no-deps <gpuforge>; docs/scripts.md)"
        )


def _device_env(spec: ScriptJobSpec) -> dict[str, str]:
    """The devices the script may use: GPUs by CUDA_VISIBLE_DEVICES, a CPU's cores by its thread count.
    Devices named already (the server's allocator names a job's GPUs, or none and a CPU slot's threads;
    a person may too) are kept as given."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        threads = os.environ.get("OMP_NUM_THREADS")
        return {"CUDA_VISIBLE_DEVICES": given, **({"OMP_NUM_THREADS": threads} if threads else {})}
    wanted = spec.resources.device_type
    if wanted in ("auto", "cuda") and _cuda_devices() >= spec.resources.processes:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(spec.resources.processes))}
    if wanted == "cuda":
        raise GpuforgeError(f"resources.device_type: cuda asked for, {_cuda_devices()} GPU(s) here")
    threads = str(max(1, usable_cores() // spec.resources.processes))
    return {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def _cuda_devices() -> int:
    """GPUs here, without importing torch (a TensorFlow job's runner need not load it)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].cuda.device_count()
    return len(list(Path("/dev").glob("nvidia[0-9]*")))


def _parent_death_signal():
    """A function for the child to call before exec: SIGKILL when this runner dies (killed itself), so no
    script outlives the job that ran it. prctl is looked up here, in the parent: nothing is imported
    after the fork. Linux only; elsewhere None and the stop signals alone."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _copy_output(process: subprocess.Popen, log_path: Path) -> None:
    """The script's output into its log as it comes (a progress bar's \\r too), and onto this terminal
    while there is one: a closed terminal must not stop the copy, or the script blocks on a full pipe."""
    terminal = True
    with open(log_path, "ab") as log:
        while chunk := process.stdout.read1(65536):
            log.write(chunk)
            log.flush()
            if terminal:
                try:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                except (OSError, ValueError):
                    terminal = False


STOPPING = {signal.SIGTERM: "cancelled", signal.SIGINT: "cancelled", signal.SIGHUP: "cancelled"}


def _forward_signals(stop: _Stop) -> dict[int, object]:
    """SIGTERM, SIGINT and SIGHUP (a closed terminal) here stop the script: saved, then killed, as the
    engine's signals do. A second one kills it at once."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handle(signum, frame) -> None:
        name = signal.Signals(signum).name
        if not stop.request(f"{name} received", STOPPING[signum], signum) and stop.running is not None:
            stop.running.signal(signal.SIGKILL)  # asked twice: no more waiting

    return {signum: signal.signal(signum, handle) for signum in STOPPING}


def _restore_signals(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _stop_process(running: _Running, run: RunDir, stop: _Stop, grace_s: float) -> None:
    """SIGTERM with the stop file once; SIGKILL when the grace period is over. Under torchrun the SIGTERM
    goes to the ranks, each once, also those torchrun starts after the stop, never to torchrun: told to
    stop, torchrun ends the ranks itself and exits 1, as after a crash; ranks that save and return end it
    with 0."""
    stop_file = run.root / track.STOP_FILE
    if time.monotonic() - stop.at > grace_s:
        running.signal(signal.SIGKILL)
        return
    if not stop_file.exists():
        stop_file.write_text(stop.reason or "stop")
        if not running.torchrun:
            running.signal(signal.SIGTERM)
    if running.torchrun:
        running.find_ranks(every_s=0)
        new = sorted(set(running.ranks) - running.stopped)
        running.stopped.update(new)
        running.signal(signal.SIGTERM, new)


def _end_group(running: _Running, wait_s: float = 2.0) -> None:
    """Once the script is gone (or must go), what it started goes too: SIGTERM to its groups, SIGKILL to
    whatever is left a moment later."""
    if running.process.poll() is None:
        running.signal(signal.SIGKILL)
        running.process.wait()
    alive = [pgid for pgid in running.groups() if _group_alive(pgid)]
    if not alive:
        return
    running.signal(signal.SIGTERM, alive)
    deadline = time.monotonic() + wait_s
    while any(_group_alive(pgid) for pgid in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    running.signal(signal.SIGKILL, alive)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid`: Linux's children lists where the kernel keeps them, else a
    look at every process's stat (elsewhere than Linux none are found)."""
    lists = list(Path(f"/proc/{pid}/task").glob("*/children"))
    if lists:
        return {int(child) for f in lists for child in _read(f).split()}
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _read(stat).rsplit(")", 1)[-1].split()  # after "pid (comm)": state, ppid, ...
        if len(fields) > 1 and fields[1] == str(pid):
            found.add(int(stat.parent.name))
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""  # gone meanwhile


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
        return int(fields[19])  # the 22nd field of stat: starttime
    except (OSError, IndexError, ValueError):
        return None


def _spent(run: RunDir) -> float:
    """What earlier attempts on this run directory cost: a budget is the job's, not one attempt's."""
    try:
        earlier = run.read_summary()
    except ValueError:
        return 0.0
    return earlier.cost_usd if earlier is not None else 0.0


STOPPED_CODES = {0, -signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL}


def _summary(
    spec, run, code, stopped: bool, stop: _Stop, wall, usd_per_hour, resume, before: float, log_start: int
):
    metrics = [m for m in read_jsonl(run.metrics_path) if isinstance(m.get("step"), int)]
    last_loss = next((m["loss"] for m in reversed(metrics) if isinstance(m.get("loss"), int | float)), None)
    evaluated = next((m for m in reversed(metrics) if any(k.startswith("eval_") for k in m)), {})
    evaluation = {k[5:]: v for k, v in evaluated.items() if k.startswith("eval_") and isinstance(v, float)}
    steps = max((m["step"] for m in metrics), default=-1) + 1
    declared = track.declared_total_steps(run.root)  # track.total_steps(), where the script said it
    if stopped:  # as asked (saved, or killed after its grace)
        status, reason = stop.status, stop.reason
    elif code == 0:
        status, reason = "finished", None
    else:  # a crash, also one while saving: its resume point is not to be trusted
        workdir = working_copy(spec, run.root)
        sent = not spec.script.workdir  # the copy a server made of the files sent
        status, reason = "failed", _failure(run.logs_dir / LOG_NAME, code, log_start, workdir, sent)
    device_type = "cuda" if _device_env(spec).get("CUDA_VISIBLE_DEVICES") else "cpu"
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    return RunSummary(
        status=status,
        reason=reason,
        steps=steps,
        total_steps=declared or steps,
        resumed_from=resume or None,
        samples_per_s=None,
        tokens_per_s=None,
        median_step_s=None,
        peak_mem_bytes=children,
        final_loss=last_loss,
        eval=evaluation or None,  # the last eval_* figures the script logged (eval_accuracy: accuracy)
        device=device_type,
        device_type=device_type,
        precision="",  # its own: gpuforge does not know it
        precision_reason="a script job chooses its own precision",
        batch_size=0,
        grad_accum=1,
        global_batch_size=0,
        parameters=0,
        trainable_parameters=0,
        flops_method="none: a script job",
        device_peak_flops=0.0,
        mfu=None,
        cost_usd=before + wall / 3600 * usd_per_hour,
        usd_per_hour=usd_per_hour,
        processes=spec.resources.processes,
        wall_s=wall,
        kind="script",
        exit_code=code,
        metrics_reported=bool(metrics),
    )


def _log_part(log_path: Path, start: int) -> str:
    """This attempt's part of the log (not an earlier attempt's), its last 64 KiB at most."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(start, log_path.stat().st_size - 64 * 1024))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _failure(log_path: Path, code: int, start: int, workdir: Path | None = None, sent: bool = False) -> str:
    """The end of this attempt's part of the log, as one line: a Python traceback's error and where in
    the job's files it was raised (the traceback itself stays in the log), else the last lines."""
    text = _log_part(log_path, start)
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    died = f"killed by {_signal_name(-code)}" if code < 0 else f"exited {code}"
    raised = _raised(lines, workdir)
    if raised is None:
        return f"the script {died}: {' | '.join(lines[-FAILURE_LINES:]) or 'no output'}"
    error, where = raised
    said = f"the script {died}: {error}{where}; its traceback is in logs/{LOG_NAME}"
    if sent and error.startswith(NOT_SENT_ERRORS):  # the server's copy: what the spec's folder has, it lacks
        said += "; a server's copy of the job holds only the files script.files names"
    return said


TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+)')
NOT_SENT_ERRORS = ("ModuleNotFoundError", "ImportError", "FileNotFoundError")


def _raised(lines: list[str], workdir: Path | None) -> tuple[str, str] | None:
    """(the error, " (at FILE line N)") of a Python traceback that ends the log, the frame the innermost
    in the job's own files (else the innermost of all); None where the log does not end in one."""
    header = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith(TRACEBACK)), None)
    if header is None:
        return None
    body = lines[header + 1 :]
    error_at = next((i for i, line in enumerate(body) if not line[:1].isspace()), None)
    if error_at is None or len(body) - error_at > FAILURE_LINES:
        return None  # no error line, or more output after it: not what ended the script
    frames = [(m.group(1), m.group(2)) for line in body[:error_at] if (m := _FRAME.match(line))]
    root = workdir.resolve() if workdir is not None else None
    own = [(f, n) for f, n in frames if root is not None and Path(f).is_relative_to(root)]
    frame = (own or frames or [None])[-1]
    if frame is None:
        return " | ".join(body[error_at:]), ""
    name = Path(frame[0]).relative_to(root).as_posix() if own else frame[0]
    return " | ".join(body[error_at:]), f" (at {name} line {frame[1]})"
