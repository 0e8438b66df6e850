"""The MiniLM LoRA example's step and evaluation, with and without what issue 39 added, side by side.

    python benchmarks/lora_step.py            # 2 epochs of steps, 10 evaluations each way, interleaved

In one process, on examples/minilm-sentiment-lora.yaml's job (the same model, data and precision):
- steps: the same optimizer steps over the epoch's batches in gpuforge's plain seeded shuffle and in
  data.group_by_length's order, alternating step by step (a neighbour on the CPUs slows both alike);
  the padded tokens a step feeds the model, each way;
- evaluation: the held-out set at the training micro-batch (as before this change) and at
  eval_batch_size's (4x), alternating; both in inference mode, batched by length.
Prints medians and the ratios, with the CPU model. A benchmark, not a test: exits 0.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.data.batches import BatchOrder  # noqa: E402
from gpuforge.hardware.probe import cpu_model_name  # noqa: E402
from gpuforge.runtime.evaluate import eval_batch_size, evaluate  # noqa: E402
from gpuforge.runtime.precision import MixedPrecision  # noqa: E402
from gpuforge.spec import load_spec  # noqa: E402
from gpuforge.train.setup import build_job  # noqa: E402
from gpuforge.train.step import forward_backward, make_optimizer  # noqa: E402

SPEC = ROOT / "examples" / "minilm-sentiment-lora.yaml"
EVALS = 10


def main() -> int:
    job = build_job(load_spec(SPEC, ["data.group_by_length=false"]))
    amp = MixedPrecision(job.precision, job.device)
    optimizer = make_optimizer(job.module, 1e-3, 0.01, job.device)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    lengths = job.data.train.lengths
    n, batch, seed = len(job.data.train), job.order.global_batch, job.spec.train.seed
    orders = {"plain": BatchOrder(n, batch, seed), "grouped": BatchOrder(n, batch, seed, lengths=lengths)}

    def step(order: BatchOrder, i: int) -> float:
        began = time.perf_counter()
        forward_backward(job.built, job.task, job.data.train, order.batch(i), job.micro, amp)
        amp.step(optimizer, trained, 1.0)
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    steps = 2 * orders["plain"].steps_per_epoch
    for i in range(2):  # the kernels' first use
        step(orders["plain"], i)
    times = {name: [] for name in orders}
    for i in range(steps):
        for name, order in orders.items():
            times[name].append(step(order, i))
    padded = {
        name: sum(max(lengths[k] for k in order.batch(i)) * batch for i in range(steps))
        for name, order in orders.items()
    }

    eval_set, micro = job.data.eval, job.micro
    batches = {"micro-batch": micro, "eval batch": eval_batch_size(micro, len(eval_set))}
    args = (job.built, job.task, eval_set)
    for size in batches.values():
        evaluate(*args, size, job.precision, job.device)
    evals = {name: [] for name in batches}
    for _ in range(EVALS):
        for name, size in batches.items():
            began = time.perf_counter()
            evaluate(*args, size, job.precision, job.device)
            evals[name].append(time.perf_counter() - began)
    job.module.train()

    plain, grouped = statistics.median(times["plain"]), statistics.median(times["grouped"])
    at_micro, at_eval = statistics.median(evals["micro-batch"]), statistics.median(evals["eval batch"])
    print(f"CPU: {cpu_model_name()} | {SPEC.name} | precision {job.precision.name} | batch {batch}")
    print(f"steps ({steps}, interleaved)   plain {1000 * plain:.1f} ms   grouped {1000 * grouped:.1f} ms")
    print(f"   padded tokens fed           plain {padded['plain']}   grouped {padded['grouped']}")
    print(f"   plain / grouped, step time  {plain / grouped:.3f}")
    print(
        f"evaluation of {len(eval_set)} examples ({EVALS} each, interleaved)   at the micro-batch "
        f"({micro}) {1000 * at_micro:.1f} ms   at the eval batch ({batches['eval batch']}) "
        f"{1000 * at_eval:.1f} ms   ratio {at_eval / at_micro:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
