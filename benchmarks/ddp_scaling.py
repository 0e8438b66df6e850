"""DDP on CPUs: 1 vs 2 processes on this machine, and gradient compression across a throttled link.

    python benchmarks/ddp_scaling.py                     # parts A and B (~3.5 min on 2 idle cores)
    python benchmarks/ddp_scaling.py --quick             # a smoke run: a few steps each
    python benchmarks/ddp_scaling.py --part b --steps-b 60 --rate-mbit 200 --json ddp.json

The job: the GPT example, examples/gpt-docstrings.yaml (bundled gpt-tiny, 4 layers, n_embd 256, 3.3M
parameters, byte tokenizer, stdlib docstrings, max length 128) with a global batch of --global-batch (32)
examples a step, split across the processes, fp32, its warm-up (20 steps, at most a quarter of the run)
and cosine decay over the steps run here, no held-out evaluation and no checkpoint but the last (the
figures below are training steps). Every run is a fresh run directory; all start from the same weights
and see the same batches (the seed and the batch order are the spec's), so their losses pair step by step.

Part A, scaling on this machine: `gpuforge train` (a subprocess, as a user runs it) with
resources.devices 1 (strategy none, OMP_NUM_THREADS 2) and devices 2 (strategy ddp: the launcher starts
2 ranks through torchrun's elastic API, gloo over loopback, 1 thread a rank), --steps-a steps each.
samples/s: the global batch / the median step time after --skip warm-up steps (rank 0's metrics.jsonl;
a step of the 2-process job ends when both ranks are done, its all-reduce included), which a neighbour's
burst moves less than the mean; summary.json's samples/s (every step, warm-up included) is shown beside it.
Scaling efficiency = samples/s(2) / (2 x samples/s(1)). On a machine with as many cores as one process
used, the 2 processes split those cores between them: this measures the cost of DDP (the all-reduce,
the extra processes), not a speed-up, which needs cores (or devices) that a single process cannot use.
A neighbour on the machine hurts the 2-thread process far more than the two 1-thread ones (its OpenMP
threads wait for each other whenever one loses its core: measured 0.85 s a step idle, 3.6-4.5 s beside
another developer's tests, where the 2 processes went from 0.72 to 1.05-1.85 s), so on a busy machine the
efficiency can come out above 1: read it with the load columns. The two final losses differ a little:
GPT-2 has dropout, and rank 1 draws its own masks.

Part B, compression on a slow link: a ThrottledLink (gpuforge.launch.throttle: two network
namespaces joined by a veth pair shaped by tbf to --rate-mbit each way) with rank 0 in one namespace and
rank 1 in the other, each started here as `python -m gpuforge.train.rank SPEC --out RUN` with the
torchrun variables set by hand (RANK, WORLD_SIZE 2, LOCAL_RANK 0, LOCAL_WORLD_SIZE 1, MASTER_ADDR rank 0's
address, MASTER_PORT), gloo bound to the namespace's interface, OMP_NUM_THREADS 1. Once for each of
`none`, `fp16`, `powersgd` (rank --powersgd-rank, plain all-reduce for the first --powersgd-start-step
steps: 10, the length of the warm-up here, as torch's PowerSGD docs advise for its start_powerSGD_iter;
in a 30-step trial from step 0 the loss jumped to 9.7 at step 13 and ended 7.5% above none's),
--steps-b steps each. Per kind:
  bytes/step    what rank 0 hands to the all-reduces a step (comm_bytes), the median over the timed steps
                (after --skip steps and PowerSGD's plain start), and its ratio to none's
  link s        the time that payload needs on the link: a 2-rank ring all-reduce sends about the payload
                each way, at --rate-mbit (payload only; frame headers add ~4%)
  step s        median step time over the timed steps; samples/s = global batch / step s; saved s: none's
                step s less this kind's, to hold against the link s it saves (the whole of it: see below)
  final loss    the loss of the last step; last-5 loss: the mean of the last 5 steps' losses (one batch's
                loss moves a few % from step to step; the mean of 5 less), each also as a change from none's
The link holds every process of the job on this machine: both ranks still share its cores.

Where the time goes on the link: the all-reduce barely overlaps the backward here. DDP puts the 13 MB of
gradients in 2 buckets after its first step (a first one of ~1 MB, then the other 12 MB up to its 25 MB
cap), and the big one is ready only when the backward is done, so a step is about its compute plus the
payload's link time, and each kind saves about the link time it cuts (measured on idle cores: none 1.26 s
a step, fp16 0.99, powersgd 0.77, against link times of 0.53, 0.26 and 0.01 s).

Floors (part B): fp16 bytes <= 1/2 of none's; powersgd bytes >= 20x fewer than none's and its samples/s
above none's on the link; fp16's and powersgd's loss after the same steps within 5% of none's (judged on
the last-5 mean; the last step alone is shown too). Part A has no floor (see above). This is a benchmark,
not a test: it prints PASS/BELOW but exits 0 (2 when a run failed). The machine's load average is printed
at the start and the end of each run: on a shared machine, read the times with it.
Every rank process is killed when a run fails or hangs (--timeout), and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.launch.throttle import ThrottledLink, can_throttle  # noqa: E402

EXAMPLE = ROOT / "examples" / "gpt-docstrings.yaml"
KINDS = ("none", "fp16", "powersgd")
MASTER_PORT = 29511  # the link's namespaces are private: no other process can hold it there
LAST_N = 5  # losses averaged at the end
LOAD_HEADER = "load 1/5 min: before -> after"
FLOOR_FP16_BYTES = 0.5  # fp16 / none
FLOOR_POWERSGD_CUT = 20.0  # none / powersgd
FLOOR_POWERSGD_SPEED = 1.0  # powersgd / none samples/s, strictly above
FLOOR_LOSS = 0.05  # relative to none


# --------------------------------------------------------------------------- the job


def job_spec(name: str, steps: int, global_batch: int, devices: int, distributed: dict | None) -> dict:
    """The GPT example, shortened to `steps` training steps of `global_batch` examples."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["name"] = name
    spec["data"]["eval_fraction"] = 0.0  # no held-out evaluation: the figures are training steps
    train = spec["train"]
    train.update(
        max_steps=steps,
        batch_size=global_batch,  # one micro-batch a process: each takes its share of the global batch
        global_batch_size=global_batch,
        precision="fp32",
        log_every=1,
        warmup_steps=min(train.get("warmup_steps") or 0, steps // 4),
    )
    for key in ("eval_every", "checkpoint_every"):
        train.pop(key, None)
    spec["resources"] = {"devices": devices}
    spec["distributed"] = distributed or {"strategy": "none"}
    return spec


def write_spec(directory: Path, spec: dict) -> Path:
    path = directory / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


# --------------------------------------------------------------------------- what a run left


@dataclass
class Run:
    name: str
    processes: int
    threads: int
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    comm_bytes: list[int] = field(default_factory=list)
    comm_bytes_uncompressed: list[int] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    wall_s: float = 0.0
    load_before: str = ""
    load_after: str = ""
    timed_from: int = 0  # the first timed step: steps before it are warm-up (or PowerSGD's plain start)

    @classmethod
    def read(cls, run_dir: Path, name: str, processes: int, threads: int, timed_from: int) -> Run:
        run = cls(name, processes, threads, timed_from=timed_from)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            run.steps.append(record["step"])
            run.losses.append(record["loss"])
            run.step_times_s.append(record["step_time_s"])
            run.comm_bytes.append(record.get("comm_bytes", 0))
            run.comm_bytes_uncompressed.append(record.get("comm_bytes_uncompressed", 0))
        run.summary = json.loads((run_dir / "summary.json").read_text())
        return run

    @property
    def load(self) -> str:
        return f"{self.load_before} -> {self.load_after}"

    def timed(self, values: list) -> list:
        picked = [v for s, v in zip(self.steps, values, strict=True) if s >= self.timed_from]
        return picked or values  # a run shorter than its warm-up: every step

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.timed(self.step_times_s))

    @property
    def samples_per_s(self) -> float:
        return self.summary["global_batch_size"] / self.median_step_s

    @property
    def bytes_per_step(self) -> float:
        return statistics.median(self.timed(self.comm_bytes))

    @property
    def final_loss(self) -> float:
        return self.losses[-1]

    @property
    def last_losses(self) -> float:
        return statistics.mean(self.losses[-LAST_N:])

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "median_step_s": self.median_step_s,
            "samples_per_s": self.samples_per_s,
            "bytes_per_step": self.bytes_per_step,
            "final_loss": self.final_loss,
            "last_losses_mean": self.last_losses,
        }


class RunFailed(RuntimeError):
    pass


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# --------------------------------------------------------------------------- part A: gpuforge train


def run_gpuforge_train(spec_path: Path, out: Path, threads: int, timeout: float) -> float:
    """`gpuforge train SPEC --out OUT` with OMP_NUM_THREADS=threads (the launcher shares them out)."""
    log = out.parent / f"{out.name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuforge", "train", str(spec_path), "--out", str(out)],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the launcher and its ranks: one process group, stopped as one
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_group(proc)
    if code != 0:
        how = f"exited with {code}" if code is not None else f"timed out after {timeout:.0f}s"
        raise RunFailed(f"gpuforge train {spec_path.name} {how}:\n{log_tail(log)}")
    return time.perf_counter() - start


def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process's group (its children too), then SIGKILL what is left after `grace`."""
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # a child it left behind
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def part_a(work: Path, args: argparse.Namespace) -> dict[str, Run]:
    runs = {}
    for processes, threads in ((1, 2), (2, 1)):
        name = f"a-{processes}p"
        distributed = {"strategy": "ddp"} if processes > 1 else None
        spec = write_spec(work, job_spec(name, args.steps_a, args.global_batch, processes, distributed))
        print(f"part A: {processes} process(es), {args.steps_a} steps ...", file=sys.stderr, flush=True)
        before = load()
        wall = run_gpuforge_train(spec, work / name, threads * processes, args.timeout)
        run = Run.read(work / name, name, processes, threads, timed_from=args.skip + 1)
        run.wall_s, run.load_before, run.load_after = wall, before, load()
        runs[name] = run
    return runs


# --------------------------------------------------------------------------- part B: across the link


def run_ranks(link: ThrottledLink, spec_path: Path, out: Path, timeout: float) -> float:
    """Rank r of 2 in namespace r; both must exit 0. A failed rank stops the other at once."""
    procs, logs = [], []
    start = time.perf_counter()
    try:
        for rank in (0, 1):
            argv = [sys.executable, "-m", "gpuforge.train.rank", str(spec_path), "--out", str(out)]
            logs.append(out.parent / f"{out.name}.rank{rank}.log")
            procs.append(link.start_rank(rank, argv, MASTER_PORT, logs[-1]))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                return time.perf_counter() - start
            if any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        what = "timed out" if all(c is None or c == 0 for c in codes) else f"exit codes {codes}"
        tails = "\n".join(f"--- rank {r} ---\n{log_tail(path)}" for r, path in enumerate(logs))
        raise RunFailed(f"{spec_path.name} across the link: {what}\n{tails}")
    finally:
        for proc in procs:
            stop_group(proc)


def part_b(work: Path, args: argparse.Namespace) -> dict[str, Run]:
    runs = {}
    # the same timed window for every kind: past the warm-up and PowerSGD's plain start
    timed_from = max(args.skip, args.powersgd_start_step) + 1
    with ThrottledLink(args.rate_mbit) as link:
        for kind in KINDS:
            name = f"b-{kind}"
            distributed = {
                "strategy": "ddp",
                "gradient_compression": kind,
                "powersgd_rank": args.powersgd_rank,
                "powersgd_start_step": args.powersgd_start_step,
                "timeout_s": 120,
            }
            spec = write_spec(work, job_spec(name, args.steps_b, args.global_batch, 2, distributed))
            print(f"part B: {kind}, {args.steps_b} steps ...", file=sys.stderr, flush=True)
            before = load()
            wall = run_ranks(link, spec, work / name, args.timeout)
            run = Run.read(work / name, name, 2, 1, timed_from=timed_from)
            run.wall_s, run.load_before, run.load_after = wall, before, load()
            runs[kind] = run
    return runs


# --------------------------------------------------------------------------- report


def floor_line(what: str, value: str, floor: str, ok: bool) -> dict:
    mark = "PASS" if ok else "BELOW"
    print(f"{what:<44}{value:>10}   {floor:<18}{mark}")
    return {"what": what, "value": value, "floor": floor, "mark": mark}


def report_a(runs: dict[str, Run], args: argparse.Namespace) -> dict:
    one, two = runs["a-1p"], runs["a-2p"]
    print(
        f"\nPart A: GPT example, global batch {args.global_batch}, {args.steps_a} steps, timed from step "
        f"{args.skip + 1}; gloo over loopback on this machine ({os.cpu_count()} cores)"
    )
    header = (
        f"{'processes':>9}{'threads':>9}{'samples/s':>11}{'summary s/s':>13}{'step s':>9}"
        f"{'bytes/step':>12}{'final loss':>12}{'wall s':>8}  {LOAD_HEADER}"
    )
    print(header)
    for run in (one, two):
        mb = f"{run.bytes_per_step / 1e6:.2f} MB" if run.processes > 1 else "-"
        print(
            f"{run.processes:>9}{run.threads:>9}{run.samples_per_s:>11.2f}"
            f"{run.summary['samples_per_s']:>13.2f}{run.median_step_s:>9.3f}{mb:>12}"
            f"{run.final_loss:>12.4f}{run.wall_s:>8.1f}  {run.load}"
        )
    efficiency = two.samples_per_s / (2 * one.samples_per_s)
    print(f"scaling efficiency samples/s(2) / (2 x samples/s(1)): {efficiency:.3f}")
    print(
        f"(samples/s: global batch / median step time from step {args.skip + 1}; summary s/s: "
        "summary.json, every step.\n Both processes share the cores the single process used: this is "
        "DDP's overhead, not a speed-up.)"
    )
    return {"efficiency": efficiency, "runs": {k: r.as_dict() for k, r in runs.items()}}


def report_b(runs: dict[str, Run], args: argparse.Namespace) -> dict:
    none = runs["none"]
    timed_from = max(args.skip, args.powersgd_start_step) + 1
    print(
        f"\nPart B: GPT example, 2 processes across a {args.rate_mbit:g} Mbit/s link (each way), global "
        f"batch {args.global_batch}, {args.steps_b} steps, timed from step {timed_from}; powersgd rank "
        f"{args.powersgd_rank}, plain for the first {args.powersgd_start_step} steps"
    )
    header = (
        f"{'kind':<10}{'bytes/step':>12}{'cut':>8}{'link s':>8}{'step s':>8}{'saved s':>9}{'samples/s':>11}"
        f"{'final loss':>12}{'vs none':>9}{'last-5 loss':>13}{'vs none':>9}{'wall s':>8}  {LOAD_HEADER}"
    )
    print(header)
    for kind, run in runs.items():
        link_s = run.bytes_per_step * 8 / (args.rate_mbit * 1e6)
        cut = none.bytes_per_step / run.bytes_per_step if run.bytes_per_step else float("nan")
        d_final = run.final_loss / none.final_loss - 1
        d_last = run.last_losses / none.last_losses - 1
        saved = none.median_step_s - run.median_step_s
        print(
            f"{kind:<10}{run.bytes_per_step / 1e6:>9.3f} MB{cut:>7.1f}x{link_s:>8.3f}"
            f"{run.median_step_s:>8.3f}{saved:>9.3f}{run.samples_per_s:>11.2f}"
            f"{run.final_loss:>12.4f}{d_final:>+9.1%}{run.last_losses:>13.4f}{d_last:>+9.1%}"
            f"{run.wall_s:>8.1f}  {run.load}"
        )
    print(
        "(bytes/step: payload rank 0 hands to all-reduces, median over the timed steps; link s: that "
        f"payload at {args.rate_mbit:g} Mbit/s;\n step s: median step time; saved s: none's step s less this "
        f"kind's (compare with the link s each saves);\n last-5 loss: the mean of the last {LAST_N} "
        "steps' losses)"
    )
    print()
    floors = []
    fp16, psgd = runs.get("fp16"), runs.get("powersgd")
    if fp16:
        ratio = fp16.bytes_per_step / none.bytes_per_step
        floors.append(floor_line("fp16 bytes / none bytes", f"{ratio:.3f}", "floor <= 0.50", ratio <= 0.5))
    if psgd:
        cut = none.bytes_per_step / psgd.bytes_per_step
        floors.append(floor_line("none bytes / powersgd bytes", f"{cut:.1f}x", "floor >= 20x", cut >= 20))
        speed = psgd.samples_per_s / none.samples_per_s
        floors.append(
            floor_line("powersgd samples/s / none samples/s", f"{speed:.2f}x", "floor > 1.00x", speed > 1.0)
        )
    for kind, run in (("fp16", fp16), ("powersgd", psgd)):
        if run:
            diff = run.last_losses / none.last_losses - 1
            floors.append(
                floor_line(
                    f"{kind} last-{LAST_N} loss vs none", f"{diff:+.2%}", "floor within 5%", abs(diff) <= 0.05
                )
            )
    return {"floors": floors, "runs": {k: r.as_dict() for k, r in runs.items()}}


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all", choices=["a", "b", "all"])
    parser.add_argument("--steps-a", type=int, default=20, help="steps of each part A run")
    parser.add_argument("--steps-b", type=int, default=40, help="steps of each part B run")
    parser.add_argument("--global-batch", type=int, default=32, help="examples a step, over all processes")
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the step times")
    parser.add_argument("--rate-mbit", type=float, default=200, help="the link's rate, each way")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument(
        "--powersgd-start-step", type=int, default=10, help="plain all-reduce before this step"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take, then killed")
    parser.add_argument("--keep", type=Path, help="keep the run directories and logs here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few steps each")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps_a, args.steps_b, args.skip, args.powersgd_start_step = 6, 10, 2, 3

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="ddp-scaling-", dir=args.keep))
    else:
        work = Path(tempfile.mkdtemp(prefix="ddp-scaling-"))
    import torch

    results: dict = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch": torch.__version__,
        "cores": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }
    failed = False
    try:
        if args.part in ("a", "all"):
            try:
                results["part_a"] = report_a(part_a(work, args), args)
            except RunFailed as err:
                print(f"\npart A failed: {err}")
                failed = True
        if args.part in ("b", "all"):
            reason = can_throttle()
            if reason is not None:
                print(f"\nPart B skipped: cannot make a throttled link here: {reason}")
                results["part_b"] = {"skipped": reason}
            else:
                try:
                    results["part_b"] = report_b(part_b(work, args), args)
                except RunFailed as err:
                    print(f"\npart B failed: {err}")
                    failed = True
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.keep:
        print(f"\nrun directories and logs in {work}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
