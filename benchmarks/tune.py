"""Hyperparameter search: gpuforge's local search against Optuna and Ray Tune on a hand loop, at equal budget.

    python benchmarks/tune.py --quick --seeds 0             # a small budget: checks the script (minutes)
    python benchmarks/tune.py                                # seeds 0 1 2, a budget of 20 trials each
    python benchmarks/tune.py --seeds 0 --budget-trials 20 --steps 160 --eval-every 20 --out /tmp/tb
    python benchmarks/tune.py --with-ray                     # adds Ray Tune (needs ray[tune]: pandas etc.)

The job: examples/digits-cnn.yaml (a small CNN, examples/models/digits_cnn.py, on scikit-learn's 8x8
digits, 20% held out, batch 64, AdamW, linear warm-up then cosine decay) trained for --steps steps with an
evaluation every --eval-every steps. The space: train.lr loguniform [1e-4, 3e-2], train.warmup_ratio
uniform [0, 0.2]; the objective: the held-out accuracy (maximize) at the last step. Every contender gets
the same budget of device-seconds, B = --budget-trials x the device-seconds of one full trial, measured
first (each seed) by a search of two trials with no pruner, the faster one (a first trial process can
be slower: cold file caches).

Contenders (each seed runs all of them, one after the other, one trial at a time):
  (a) gpuforge TPE+ASHA  gpuforge tune --local: TPE, pruner asha (reduction factor 3, min_steps = the
                         first evaluation), budget {hours: B/3600}, max_trials 1000, parallel 1
  (b) Optuna hand loop   one process: optuna TPESampler (multivariate, as gpuforge's) + HyperbandPruner
                         (min_resource = the first evaluation, max_resource = --steps, factor 3) driving a
                         careful PyTorch loop: the same builder, data (load_digits, gpuforge's seeded 20%
                         split), batches (seeded per-epoch shuffle, ragged tail dropped), AdamW (no decay on
                         biases and norms, fused), schedule (warm-up of round(ratio x steps), cosine to
                         0.1 x lr), clipping at 1.0, the precision gpuforge's `auto` picked (from the plain
                         trial's summary), evaluations at the same steps, trial.report / should_prune;
                         trials until their summed wall-seconds (model build to last eval) reach B
  (c) Ray Tune ASHA      (--with-ray) ray.tune's ASHAScheduler (grace 1 evaluation, factor 3) and its
                         random search driving the same hand loop, ray.init(num_cpus=2), one trial at a
                         time (2 CPUs each); a trial's device-seconds are its own (the trainable's clock)
  (d) gpuforge random    gpuforge tune --local: random sampling, no pruner, the same budget
Device-seconds of a gpuforge trial: `device_s` of `gpuforge tune show --json` (the trial process's wall
time, process start included). Trials count in completion order (number order: parallel 1); the best is
the best final accuracy of the trials that finished (a pruned or stopped trial's figure is not a model's),
and a trial counts only if the cumulated device-seconds at its end are within B.

Before each contender it waits (--quiet-wait, up to 120 s) until other processes use under 15% of the
CPUs: on two cores a busy neighbour makes torch's two threads wait on each other, and a step takes many
times longer (seen here: a hand-loop trial of 80 steps at 12 s instead of 0.4 s). Per contender and seed
the script prints: trials run (finished/pruned), the final best, the
device-seconds to reach (d)'s final best ('never' when it does not), and the share of the CPUs other
processes used meanwhile (a shared machine: read the figures beside it).

Overhead per gpuforge trial (process start, imports, model and data set-up, the first step, the end): a
finished trial's device_s less its loop time (the `finished` event's ts less the `started` event's ts,
the first step's step_time_s added back), as a share of device_s; also the share of device_s that is not
a training step (1 - sum of step_time_s / device_s: evaluations and checkpoints count as overhead there).
It is measured on the digits trials of (a) and (d), and on one MiniLM LoRA trial
(examples/minilm-sentiment-lora.yaml, a tune file searching train.lr only, --minilm-trials trials of
--minilm-steps steps), which is where the floor applies: warm (the default: one worker process runs the
trials, its start charged to the first) and --process-per-trial, side by side; the floor reads the warm
search's share (its trials' overheads summed over their device-seconds). The share depends on how fast
the steps are: a neighbour slowing the steps ten-fold makes it look ten times smaller (its "others"
figure is printed).

Floors (PASS/BELOW on the medians over the seeds): (a) reaches (d)'s final best within 0.35 x (d)'s
device-seconds; at the full budget (a)'s best is within 0.005 accuracy of (b)'s and (c)'s; the overhead
is at most 10% of a MiniLM LoRA trial's time. A benchmark, not a test: it always exits 0 unless a
contender fails outright (2).

--out DIR (default: a temporary folder) keeps each search's folder, results.json (every trial and curve)
and, where matplotlib is importable, best-vs-device-seconds.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DIGITS_SPEC = ROOT / "examples" / "digits-cnn.yaml"
MODEL_FILE = ROOT / "examples" / "models" / "digits_cnn.py"
MINILM_SPEC = ROOT / "examples" / "minilm-sentiment-lora.yaml"

LR_RANGE = (1e-4, 3e-2)
WARMUP_RANGE = (0.0, 0.2)
# the digits job's settings the hand loop reproduces (examples/digits-cnn.yaml and gpuforge's defaults)
BATCH_SIZE, CHANNELS, EVAL_FRACTION = 64, 32, 0.2
WEIGHT_DECAY, MIN_LR_RATIO, GRAD_CLIP = 0.01, 0.1, 1.0
REDUCTION_FACTOR = 3
PLAIN_TRIALS = 2
MAX_TRIALS = 1000  # gpuforge's largest: the budget ends the search
TPE_STARTUP = 10  # what gpuforge's TPE gets with max_trials 1000 (space.tpe_startup_trials); (b) gets it too

SPEEDUP_FLOOR = 0.35  # (a)'s device-seconds to (d)'s final best, at most this share of (d)'s
ACCURACY_MARGIN = 0.005  # (a)'s final best, at most this far below (b)'s and (c)'s
OVERHEAD_FLOOR = 0.10  # gpuforge's per-trial overhead, at most this share of a MiniLM LoRA trial
QUIET = 0.15  # before each contender: wait until other processes use less than this share of the CPUs
BUSY = 0.10  # a figure measured while others used more than this share of the CPUs is marked '?'

NAMES = {
    "a": "(a) gpuforge TPE+ASHA",
    "b": "(b) Optuna TPE+Hyperband, hand loop",
    "c": "(c) Ray Tune ASHA, hand loop",
    "d": "(d) gpuforge random, no pruner",
    "e": "(e) gpuforge TPE+ASHA, pause at rungs",
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


# --------------------------------------------------------------------------- the CPUs others used


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _own_cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class CpuWatch:
    """The share of the machine's CPUs that processes outside this one (and its waited-for children) used
    between start() and others(): approximate (a child not yet reaped counts as others')."""

    def start(self) -> CpuWatch:
        self.jiffies, self.own, self.t0 = _cpu_jiffies(), _own_cpu_s(), time.monotonic()
        return self

    def others(self) -> float:
        busy0, total0 = self.jiffies
        busy1, total1 = _cpu_jiffies()
        if total1 <= total0:
            return 0.0
        hz = os.sysconf("SC_CLK_TCK")
        own_jiffies = (_own_cpu_s() - self.own) * hz
        return max(0.0, (busy1 - busy0 - own_jiffies) / (total1 - total0))


def wait_quiet(max_s: float, what: str) -> None:
    """Wait (at most max_s) until other processes use under QUIET of the CPUs over a second: on 2 cores,
    a busy neighbour makes torch's threads wait on each other and a step many times slower."""
    t0 = time.monotonic()
    while True:
        busy0, total0 = _cpu_jiffies()
        time.sleep(1.0)
        busy1, total1 = _cpu_jiffies()
        share = (busy1 - busy0) / max(1, total1 - total0)
        if share < QUIET or time.monotonic() - t0 >= max_s:
            break
    waited = time.monotonic() - t0
    if waited > 1.5:
        print(
            f"  (waited {waited:.0f} s for a quiet machine before {what}; others at {share:.0%})", flush=True
        )


# --------------------------------------------------------------------------- what a contender did


@dataclass
class Trial:
    number: int
    state: str  # finished, pruned, stopped, failed
    value: float | None  # the final held-out accuracy of a finished trial
    device_s: float
    params: dict[str, Any]
    curve: list[list[float]] = field(default_factory=list)  # [step, eval_accuracy]


@dataclass
class Outcome:
    key: str
    budget_s: float
    trials: list[Trial]
    wall_s: float  # the contender's own wall time, start-up and driver included
    others_cpu: float
    note: str = ""

    def curve(self) -> list[list[float]]:
        """[cumulated device-seconds, best final accuracy so far] after each trial within the budget."""
        points, spent, best = [], 0.0, None
        for t in self.trials:
            spent += t.device_s
            if spent > self.budget_s * (1 + 1e-9):
                break
            if t.state == "finished" and t.value is not None and (best is None or t.value > best):
                best = t.value
            points.append([spent, best])
        return points

    def final_best(self) -> float | None:
        curve = self.curve()
        return curve[-1][1] if curve else None

    def seconds_to(self, target: float | None) -> float | None:
        if target is None:
            return None
        for spent, best in self.curve():
            if best is not None and best >= target - 1e-12:
                return spent
        return None

    def counts(self) -> str:
        n = len(self.curve())
        done = self.trials[:n]
        fin = sum(t.state == "finished" for t in done)
        pruned = sum(t.state == "pruned" for t in done)
        return f"{n} ({fin}/{pruned})"


# --------------------------------------------------------------------------- gpuforge's search


def tune_file(path: Path, sampler: str, pruner: dict | None, seed: int, budget_s: float | None,
              parameters: dict | None = None) -> Path:  # fmt: skip
    import yaml

    doc: dict[str, Any] = {
        "objective": {"metric": "eval_accuracy", "direction": "maximize"},
        "parameters": parameters
        or {
            "train.lr": {"loguniform": list(LR_RANGE)},
            "train.warmup_ratio": {"uniform": list(WARMUP_RANGE)},
        },
        "sampler": sampler,
        "pruner": pruner or "none",
        "max_trials": MAX_TRIALS,
        "parallel": 1,
        "seed": seed,
    }
    if budget_s is not None:
        doc["budget"] = {"hours": budget_s / 3600}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def gpuforge_search(spec: Path, tune: Path, out: Path, overrides: list[str], max_trials: int | None = None,
                    extra: list[str] | None = None) -> tuple[dict[str, Any], float]:  # fmt: skip
    """`gpuforge tune SPEC --tune TUNE --local --out OUT --json`: `tune show`'s JSON, and the wall time."""
    cmd = [sys.executable, "-m", "gpuforge", "tune", str(spec), "--tune", str(tune), "--local",
           "--out", str(out), "--json", *(extra or [])]  # fmt: skip
    if max_trials is not None:
        cmd += ["--max-trials", str(max_trials)]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        show = subprocess.run([sys.executable, "-m", "gpuforge", "tune", "show", str(out), "--json"],
                              capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
        doc = json.loads(show.stdout)
    return doc, wall


def trials_of(doc: dict[str, Any]) -> list[Trial]:
    return [
        Trial(
            t["number"],
            t["state"],
            t["value"] if t["state"] == "finished" else None,
            float(t["device_s"] or 0.0),
            t["params"],
            t.get("curve") or [],
        )  # fmt: skip
        for t in sorted(doc["trials"], key=_ended_at)
    ]


def _ended_at(trial: dict[str, Any]) -> tuple[float, int]:
    """When a trial last wrote to its run directory: the order trials end in (a paused trial, resumed
    later, ends after trials numbered above it)."""
    run = Path(trial["run"]) if trial.get("run") else None
    times = [p.stat().st_mtime for p in run.iterdir() if p.is_file()] if run and run.is_dir() else []
    return (max(times) if times else math.inf, trial["number"])


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def overhead(doc: dict[str, Any]) -> list[dict[str, float]]:
    """Each finished trial's overhead: start-up (process start to step 1, the first step, the end) and
    the share of its device_s that is no training step."""
    rows = []
    for t in doc["trials"]:
        if t["state"] != "finished" or not t.get("run"):
            continue
        run = Path(t["run"])
        events = _read_jsonl(run / "events.jsonl")
        started = next((e for e in events if e.get("event") == "started"), None)
        finished = next((e for e in events if e.get("event") == "finished"), None)
        steps = [m for m in _read_jsonl(run / "metrics.jsonl") if isinstance(m.get("step_time_s"), float)]
        if started is None or finished is None or not steps:
            continue
        device_s = float(t["device_s"])
        step_s = sum(m["step_time_s"] for m in steps)
        first = next((m["step_time_s"] for m in steps if m.get("step") == 1), 0.0)
        loop_s = finished["ts"] - started["ts"] - first
        rows.append({
            "device_s": device_s,
            "setup_s": float(started.get("setup_s") or 0.0),
            "loop_s": loop_s,
            "step_s": step_s,
            "startup_share": (device_s - loop_s) / device_s,
            "non_step_share": 1 - step_s / device_s,
        })  # fmt: skip
    return rows


# --------------------------------------------------------------------------- the hand loop


def split(n: int, fraction: float, seed: int):
    """gpuforge's seeded split (data/prepare.py), so that every contender holds out the same examples."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(n)
    n_eval = min(max(int(round(n * fraction)), 1), n - 1)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def load_data(seed: int) -> dict[str, Any]:
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]  # N x 1 x 8 x 8, in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    train_idx, eval_idx = split(len(y), EVAL_FRACTION, seed)
    return {"x": x[train_idx], "y": y[train_idx], "ex": x[eval_idx], "ey": y[eval_idx]}


def load_builder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_cnn", MODEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build


def hand_trial(lr: float, warmup_ratio: float, data: dict[str, Any], steps: int, eval_every: int, seed: int,
               precision: str, report) -> tuple[float | None, list[list[float]]]:  # fmt: skip
    """Train one trial; `report(step, accuracy)` after each evaluation returns True to prune it. The final
    accuracy (None when pruned) and the curve."""
    import contextlib

    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    model = load_builder()(num_labels=10, channels=CHANNELS)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, fused=True,
    )  # fmt: skip
    warmup = round(warmup_ratio * steps)

    def factor(s: int) -> float:
        if warmup > 0 and s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, steps - warmup))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def autocast():
        if precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    x, y, ex, ey = data["x"], data["y"], data["ex"], data["ey"]
    per_epoch = len(y) // BATCH_SIZE
    order, epoch = None, -1
    curve: list[list[float]] = []
    accuracy = None
    model.train()
    for step in range(1, steps + 1):
        e, within = divmod(step - 1, per_epoch)
        if e != epoch:
            order, epoch = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + e)), e
        idx = order[within * BATCH_SIZE : (within + 1) * BATCH_SIZE]
        with autocast():
            loss = F.cross_entropy(model(x[idx]).float(), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        schedule.step()
        if step % eval_every == 0 or step == steps:
            model.eval()
            correct = 0
            with torch.no_grad(), autocast():
                for start in range(0, len(ey), BATCH_SIZE):
                    logits = model(ex[start : start + BATCH_SIZE])
                    correct += int((logits.argmax(-1) == ey[start : start + BATCH_SIZE]).sum())
            model.train()
            accuracy = correct / len(ey)
            curve.append([step, accuracy])
            if step != steps and report(step, accuracy):
                return None, curve
    return accuracy, curve


def optuna_contender(seed: int, steps: int, eval_every: int, budget_s: float, precision: str) -> Outcome:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    watch, t_start = CpuWatch().start(), time.monotonic()
    t0 = time.perf_counter()
    data = load_data(seed)
    spent = time.perf_counter() - t0  # loading the data once counts, into the first trial
    study = optuna.create_study(
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=TPE_STARTUP, multivariate=True),
        pruner=optuna.pruners.HyperbandPruner(
            min_resource=eval_every, max_resource=steps, reduction_factor=REDUCTION_FACTOR
        ),
    )
    trials: list[Trial] = []
    while spent < budget_s:
        t0 = time.perf_counter()
        trial = study.ask()
        lr = trial.suggest_float("train.lr", *LR_RANGE, log=True)
        warmup = trial.suggest_float("train.warmup_ratio", *WARMUP_RANGE)

        def report(step: int, value: float, trial=trial) -> bool:
            trial.report(value, step)
            return trial.should_prune()

        value, curve = hand_trial(lr, warmup, data, steps, eval_every, seed, precision, report)
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, value)
        seconds = time.perf_counter() - t0 + (spent if not trials else 0.0)
        spent += time.perf_counter() - t0
        trials.append(Trial(trial.number, "finished" if value is not None else "pruned", value, seconds,
                            dict(trial.params), curve))  # fmt: skip
    return Outcome("b", budget_s, trials, time.monotonic() - t_start, watch.others())


def ray_contender(seed: int, steps: int, eval_every: int, budget_s: float, precision: str,
                  work: Path) -> Outcome:  # fmt: skip
    """Ray Tune: ASHAScheduler and its random search over the same hand loop. Each report appends a line
    (trial id, step, accuracy, the trial's own seconds so far) to a file; a Stopper ends the experiment once
    the trials' own seconds reach the budget."""
    import ray
    from ray import tune

    log = work / f"ray-seed{seed}.jsonl"
    log.unlink(missing_ok=True)
    watch, t_start = CpuWatch().start(), time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        data = load_data(seed)

        def trainable(config, data=None):
            import torch

            torch.set_num_threads(2)
            t0 = time.perf_counter()
            trial_id = tune.get_context().get_trial_id()

            def report(step: int, value: float) -> bool:
                seconds = time.perf_counter() - t0
                with open(log, "a") as f:
                    f.write(json.dumps({"trial": trial_id, "step": step, "acc": value, "s": seconds,
                                        "params": config, "ts": time.time()}) + "\n")  # fmt: skip
                tune.report({"eval_accuracy": value, "step": step, "trial_s": seconds})
                return False  # ASHA stops the trial from outside

            value, _ = hand_trial(config["train.lr"], config["train.warmup_ratio"], data, steps, eval_every,
                                  seed, precision, report)  # fmt: skip
            report(steps, value)

        class Budget(tune.Stopper):
            def __init__(self):
                self.seconds: dict[str, float] = {}

            def __call__(self, trial_id, result):
                self.seconds[trial_id] = float(result.get("trial_s", 0.0))
                return False

            def stop_all(self):
                return sum(self.seconds.values()) >= budget_s

        run_config = getattr(tune, "RunConfig", None)
        if run_config is None:
            from ray.train import RunConfig as run_config
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(trainable, data=data), {"cpu": 2}),
            param_space={
                "train.lr": tune.loguniform(*LR_RANGE),
                "train.warmup_ratio": tune.uniform(*WARMUP_RANGE),
            },
            tune_config=tune.TuneConfig(
                metric="eval_accuracy",
                mode="max",
                num_samples=MAX_TRIALS,
                max_concurrent_trials=1,
                scheduler=tune.schedulers.ASHAScheduler(
                    time_attr="step", max_t=steps, grace_period=eval_every, reduction_factor=REDUCTION_FACTOR
                ),
            ),
            run_config=run_config(stop=Budget(), verbose=0, storage_path=str(work / "ray-results")),
        )
        tuner.fit()
    finally:
        ray.shutdown()
    by_trial: dict[str, list[dict[str, Any]]] = {}
    for line in _read_jsonl(log):
        by_trial.setdefault(line["trial"], []).append(line)
    trials = []
    for number, lines in enumerate(sorted(by_trial.values(), key=lambda ls: ls[-1]["ts"])):
        last = lines[-1]
        done = last["step"] == steps
        curve = [[x["step"], x["acc"]] for x in lines if x["step"] != steps or x is lines[-1]]
        trials.append(Trial(number, "finished" if done else "pruned", last["acc"] if done else None,
                            last["s"], last["params"], curve))  # fmt: skip
    return Outcome("c", budget_s, trials, time.monotonic() - t_start, watch.others(),
                   note="random search; own seconds (Ray's actor start-up not counted)")  # fmt: skip


# --------------------------------------------------------------------------- one seed


def run_seed(seed: int, args, work: Path) -> dict[str, Any]:
    work = work / f"seed{seed}"
    work.mkdir(parents=True, exist_ok=True)
    overrides = [f"train.max_steps={args.steps}", f"train.eval_every={args.eval_every}",
                 f"train.seed={seed}"]  # fmt: skip

    # the first trial process on a machine can be slower (file caches, gpuforge's per-machine caches): two
    # plain trials, the faster one is "one full trial"
    print(f"\nseed {seed}: plain trials ...", flush=True)
    wait_quiet(args.quiet_wait, "the plain trials")
    watch = CpuWatch().start()
    doc, _ = gpuforge_search(DIGITS_SPEC, tune_file(work / "plain.yaml", "random", None, seed, None),
                             work / "plain", overrides, max_trials=PLAIN_TRIALS)  # fmt: skip
    plain = trials_of(doc)
    if any(t.state != "finished" for t in plain):
        raise RuntimeError(f"a plain trial did not finish: see {work / 'plain'}")
    trial_s = min(t.device_s for t in plain)
    shown = ", ".join(f"{t.device_s:.2f}" for t in plain)
    print(f"seed {seed}: plain trials {shown} device-s (others used {watch.others():.0%} of the CPUs)")
    summary = json.loads((Path(doc["trials"][0]["run"]) / "summary.json").read_text())
    precision = summary.get("precision") or "fp32"
    budget = args.budget_trials * trial_s
    print(
        f"seed {seed}: a trial {trial_s:.2f} device-s ({precision}); budget {budget:.1f} device-s", flush=True
    )

    outcomes: dict[str, Outcome] = {}
    docs: dict[str, dict[str, Any]] = {}
    asha = {"asha": {"min_steps": args.eval_every, "reduction_factor": REDUCTION_FACTOR}}
    paused = {"asha": {**asha["asha"], "pause": True}}
    for key, sampler, pruner in (("a", "tpe", asha), ("e", "tpe", paused), ("d", "random", None)):
        print(f"seed {seed}: {NAMES[key]} ...", flush=True)
        wait_quiet(args.quiet_wait, NAMES[key])
        watch = CpuWatch().start()
        docs[key], wall = gpuforge_search(
            DIGITS_SPEC, tune_file(work / f"tune-{key}.yaml", sampler, pruner, seed, budget),
            work / f"search-{key}", overrides,
        )  # fmt: skip
        outcomes[key] = Outcome(key, budget, trials_of(docs[key]), wall, watch.others(),
                                note=f"search {docs[key]['state']}")  # fmt: skip
    print(f"seed {seed}: {NAMES['b']} ...", flush=True)
    wait_quiet(args.quiet_wait, NAMES["b"])
    outcomes["b"] = optuna_contender(seed, args.steps, args.eval_every, budget, precision)
    if args.with_ray:
        print(f"seed {seed}: {NAMES['c']} ...", flush=True)
        wait_quiet(args.quiet_wait, NAMES["c"])
        try:
            outcomes["c"] = ray_contender(seed, args.steps, args.eval_every, budget, precision, work)
        except Exception as err:  # noqa: BLE001 - Ray missing pieces (ray[tune] needs pandas...): say so, go on
            print(f"seed {seed}: Ray Tune could not run: {type(err).__name__}: {err}", flush=True)

    over = [row for key in ("a", "d") for row in overhead(docs[key])]
    return {"seed": seed, "trial_s": trial_s, "precision": precision, "budget_s": budget,
            "outcomes": outcomes, "overhead": over}  # fmt: skip


def minilm_overhead(args, work: Path) -> dict[str, Any] | None:
    """A search of --minilm-trials MiniLM LoRA trials, warm (the default) and --process-per-trial, one
    after the other: each trial's overhead, and the search's (what its trials' overheads sum to, over
    what they held the device: the warm worker's start is charged to its first trial)."""
    path = tune_file(work / "minilm-tune.yaml", "random", None, 0, None,
                     parameters={"train.lr": {"loguniform": [1e-3, 1e-2]}})  # fmt: skip
    found: dict[str, Any] = {}
    # a trial in a process of its own pays the same start every time: three show it
    for mode, extra, trials in (
        ("warm", [], args.minilm_trials),
        ("process_per_trial", ["--process-per-trial"], min(3, args.minilm_trials)),
    ):
        print(f"\nMiniLM LoRA ({mode}): {trials} trials of {args.minilm_steps} steps ...", flush=True)
        wait_quiet(args.quiet_wait, f"the MiniLM LoRA trials ({mode})")
        watch = CpuWatch().start()
        try:
            doc, wall = gpuforge_search(
                MINILM_SPEC, path, work / f"minilm-{mode}", [f"train.max_steps={args.minilm_steps}"],
                max_trials=trials, extra=extra,
            )  # fmt: skip
        except (RuntimeError, subprocess.CalledProcessError) as err:
            print(f"MiniLM LoRA trials failed: {err}", flush=True)
            return None
        rows = overhead(doc)
        if not rows:
            return None
        device_s = sum(r["device_s"] for r in rows)
        found[mode] = {
            "wall_s": wall, "others_cpu": watch.others(), "trials": rows, "count": len(rows),
            "device_s": device_s, "step_s": sum(r["step_s"] for r in rows),
            "startup_share": sum(r["device_s"] - r["loop_s"] for r in rows) / device_s,
            "non_step_share": 1 - sum(r["step_s"] for r in rows) / device_s,
            "first_startup_share": rows[0]["startup_share"],
            "later_startup_share": _median([r["startup_share"] for r in rows[1:]]),
        }  # fmt: skip
    return found


# --------------------------------------------------------------------------- the tables


def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.1f}"


def _acc(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def seed_table(r: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    outcomes: dict[str, Outcome] = r["outcomes"]
    target = outcomes["d"].final_best()
    figures = {}
    lines = [
        f"seed {r['seed']}: budget {r['budget_s']:.1f} device-s = {r['budget_s'] / r['trial_s']:.0f} x one "
        f"trial ({r['trial_s']:.2f} s, {r['precision']}); target = (d)'s final best {_acc(target)}",
        f"  {'contender':<38} {'trials (fin/pruned)':>19} {'final best':>10} {'s to target':>11} "
        f"{'x (d)':>6} {'wall s':>7} {'others':>6}",
    ]
    d_curve = outcomes["d"].curve()
    d_total = d_curve[-1][0] if d_curve else None  # (d)'s device-seconds within the budget
    for key in ("a", "e", "b", "c", "d"):
        o = outcomes.get(key)
        if o is None:
            lines.append(f"  {NAMES[key]:<38} {'(not run)':>19}")
            continue
        to = o.seconds_to(target)
        share = None if to is None or not d_total else to / d_total  # the floor's measure
        figures[key] = {"final_best": o.final_best(), "seconds_to_target": to, "share_of_budget": share}
        lines.append(
            f"  {NAMES[key]:<38} {o.counts():>19} {_acc(o.final_best()):>10} {_s(to):>11} "
            f"{'-' if share is None else f'{share:.2f}':>6} {o.wall_s:>7.1f} {o.others_cpu:>6.0%}"
            + ("?" if o.others_cpu > BUSY else "")
            + (f"  {o.note}" if o.note else "")
        )
    over = r["overhead"]
    if over:
        lines.append(
            f"  gpuforge digits trial overhead (finished trials of (a), (d), n={len(over)}): start-up "
            f"{statistics.median(x['startup_share'] for x in over):.0%} of device_s (median "
            f"{statistics.median(x['device_s'] - x['loop_s'] for x in over):.2f} s of "
            f"{statistics.median(x['device_s'] for x in over):.2f} s; set-up "
            f"{statistics.median(x['setup_s'] for x in over):.2f} s), no training step "
            f"{statistics.median(x['non_step_share'] for x in over):.0%}"
        )
    a = [t for t in outcomes["a"].trials if t.state in ("finished", "pruned")]
    for state in ("pruned", "finished"):
        mine = [t for t in a if t.state == state]
        if mine:
            lines.append(
                f"  (a) a {state} trial: median {statistics.median(t.device_s for t in mine):.2f} device-s, "
                f"{statistics.median(t.curve[-1][0] if t.curve else 0 for t in mine):.0f} steps "
                f"(n={len(mine)})"
            )
    return lines, figures


def _median(values: list[float | None]) -> float | None:
    """The median, 'never' (None) counting as worst (infinite)."""
    if not values:
        return None
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else m


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "BELOW")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; the curves are in results.json)")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        for key, o in r["outcomes"].items():
            pts = [(s, b) for s, b in o.curve() if b is not None]
            if pts:
                ax.step(*zip(*pts, strict=True), where="post", label=NAMES[key])
        ax.set_title(f"seed {r['seed']}")
        ax.set_xlabel("device-seconds")
        ax.set_ylabel("best eval accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seeds", type=int, nargs="*", default=[0, 1, 2], help="digits seeds (none: only MiniLM)"
    )
    parser.add_argument("--budget-trials", type=float, default=20, help="the budget, in full trials")
    parser.add_argument("--steps", type=int, default=160, help="steps of a full trial")
    parser.add_argument("--eval-every", type=int, default=20, help="an evaluation every N steps")
    parser.add_argument("--minilm-steps", type=int, default=60, help="steps of a MiniLM LoRA trial")
    parser.add_argument("--minilm-trials", type=int, default=12, help="MiniLM LoRA trials in its search")
    parser.add_argument("--quiet-wait", type=float, default=120,
                        help="max seconds to wait for a quiet machine before each contender")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="work folder (default: a temporary one)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small budget (6 trials of 80 steps, MiniLM 20 steps): checks the script",
    )
    parser.add_argument(
        "--with-ray",
        action="store_true",
        help="run (c) Ray Tune (ray[tune]: ray.tune imports pandas, absent here)",
    )
    args = parser.parse_args()
    if args.quick:
        args.budget_trials, args.steps, args.minilm_steps, args.minilm_trials = 6, 80, 20, 3
    work = args.out or Path(tempfile.mkdtemp(prefix="gpuforge-tune-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cpu = cpu_model()
    print(f"tune benchmark on {cpu}; work folder {work}")
    print(
        f"digits CNN, {args.steps} steps a trial, eval every {args.eval_every}; "
        f"budget {args.budget_trials:g} trials; seeds {args.seeds}"
    )

    t_all = time.monotonic()
    results, failed = [], False
    for seed in args.seeds:
        try:
            results.append(run_seed(seed, args, work))
        except (RuntimeError, subprocess.CalledProcessError) as err:
            print(f"seed {seed} failed: {err}")
            failed = True
    minilm = minilm_overhead(args, work)

    print(f"\n=== results ({cpu}) ===")
    per_seed = []
    for r in results:
        lines, figures = seed_table(r)
        per_seed.append(figures)
        print("\n".join(lines))
    print(
        "  (s to target: cumulated device-seconds until the best reaches (d)'s final best; x (d): that as a "
        "share of (d)'s device-seconds;\n   others: the share of the CPUs other processes used meanwhile, "
        f"'?' above {BUSY:.0%}: a busy neighbour slows torch's threads many times over)"
    )

    def med(key: str, what: str) -> float | None:
        return _median([f[key][what] for f in per_seed if key in f])

    floors = []
    if per_seed:
        print(f"\nmedian over {len(per_seed)} seed(s) ({cpu}):")
        for key in ("a", "e", "b", "c", "d"):
            if any(key in f for f in per_seed):
                print(f"  {NAMES[key]:<38} final best {_acc(med(key, 'final_best'))}   "
                      f"s to (d)'s best {_s(med(key, 'seconds_to_target'))}   "
                      f"share of (d)'s device-s {_acc(med(key, 'share_of_budget'))}")  # fmt: skip
        share = med("a", "share_of_budget")
        floors.append((f"(a) reaches (d)'s final best within {SPEEDUP_FLOOR} x (d)'s device-seconds",
                       share is not None and share <= SPEEDUP_FLOOR,
                       f"{'never' if share is None else f'{share:.2f} x'}"))  # fmt: skip
        a_best = med("a", "final_best")
        for other in ("b", "c"):
            o_best = med(other, "final_best")
            if o_best is None or a_best is None:
                floors.append((f"(a)'s final best within {ACCURACY_MARGIN} of ({other})'s", None, "not run"))
                continue
            floors.append((f"(a)'s final best within {ACCURACY_MARGIN} of ({other})'s",
                           a_best >= o_best - ACCURACY_MARGIN, f"{a_best:.4f} vs {o_best:.4f}"))  # fmt: skip
    if minilm:
        print(f"\nMiniLM LoRA trials of {args.minilm_steps} steps ({cpu}):")
        for mode, m in minilm.items():
            later = "-" if m["later_startup_share"] is None else f"{m['later_startup_share']:.1%}"
            print(
                f"  {mode:<18} {m['count']:>2} trials, device_s {m['device_s']:.1f} s (steps "
                f"{m['step_s']:.1f} s); start-up overhead {m['startup_share']:.1%} of the search (first "
                f"trial {m['first_startup_share']:.1%}, later ones {later}); "
                f"no training step {m['non_step_share']:.1%}; "
                f"others used {m['others_cpu']:.0%} of the CPUs"
            )
        warm = minilm["warm"]
        floors.append(
            (
                f"gpuforge's overhead at most {OVERHEAD_FLOOR:.0%} of a MiniLM LoRA trial (over a search of "
                f"{args.minilm_trials})",
                warm["startup_share"] <= OVERHEAD_FLOOR,
                f"{warm['startup_share']:.1%}",
            )
        )
    else:
        floors.append(("gpuforge's overhead on a MiniLM LoRA trial", None, "not measured"))
    print("\nfloors:")
    for what, ok, shown in floors:
        print(f"  {verdict(ok):<5} {what}: {shown}")
    print(f"\ntotal wall time {time.monotonic() - t_all:.0f} s")

    dump = {
        "cpu": cpu,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seeds": [
            {
                **{k: v for k, v in r.items() if k != "outcomes"},
                "contenders": {
                    key: {**asdict(o), "name": NAMES[key], "curve": o.curve(), "final_best": o.final_best()}
                    for key, o in r["outcomes"].items()
                },
                "figures": f,
            }
            for r, f in zip(results, per_seed, strict=True)
        ],
        "minilm": minilm,
        "floors": [{"floor": w, "ok": ok, "figure": s} for w, ok, s in floors],
    }
    (work / "results.json").write_text(json.dumps(dump, indent=1))
    print(f"curves and trials: {work / 'results.json'}")
    plot(results, work / "best-vs-device-seconds.png")
    return 2 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
