"""Does a new batch shape cost the model set-up time (a oneDNN kernel built for it), and would padding the
sequence length to a multiple of 16 (fewer shapes) pay? fp32 against bf16, on a served classifier.

    python benchmarks/serve_shapes.py MODEL_DIR      # a run's model/ (benchmarks/serve_load.py trains one)

For 200 batches of fixed size 32 and 200 of random sizes 1..32, drawn from examples/data/topics.jsonl:
samples/s, the shapes seen, and the time per sample of a batch whose shape is new against one seen before.
The padded variant times the forward alone (no softmax or result dicts), so its figures are an upper bound.
"""

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from serve_baselines import sentences  # noqa: E402

from gpuforge.artifact import built_from  # noqa: E402
from gpuforge.runtime import tasks  # noqa: E402
from gpuforge.runtime.precision import autocast  # noqa: E402
from gpuforge.serve.predict import load_predictor  # noqa: E402


def batches(rng: random.Random, texts: list[str], n: int, sizes: list[int]) -> list[list]:
    return [[(None, t) for t in rng.sample(texts, rng.choice(sizes))] for _ in range(n)]


def run(p, batch: list, multiple: int | None) -> None:
    """The served batch path, or (padded to `multiple` tokens) the forward alone."""
    if multiple is None:
        p.run_batch(batch)
        return
    encoded = p.tokenizer(
        [x for _, x in batch], padding=True, pad_to_multiple_of=multiple, return_tensors="pt"
    )
    inputs = {k: v for k, v in encoded.items() if k in ("input_ids", "attention_mask")}
    with torch.inference_mode(), autocast(p.precision, p.device):
        tasks.forward(built_from(p.module, p.manifest), p.task, inputs)


def measure(p, plan: list, multiple: int | None) -> str:
    p.warm_up((1, 8, 32))
    seen, firsts, repeats, items = set(), [], [], 0
    began = time.perf_counter()
    for batch in plan:
        encoded = p.tokenizer([x for _, x in batch], padding=True, pad_to_multiple_of=multiple)
        shape = (len(batch), len(encoded["input_ids"][0]))
        start = time.perf_counter()
        run(p, batch, multiple)
        (repeats if shape in seen else firsts).append((time.perf_counter() - start) / len(batch))
        seen.add(shape)
        items += len(batch)
    rate = items / (time.perf_counter() - began)
    first = 1000 * statistics.mean(firsts)
    repeat = 1000 * statistics.mean(repeats) if repeats else float("nan")
    return f"{rate:7.1f} samples/s  shapes {len(seen):4}  ms/sample: new shape {first:.2f}, seen {repeat:.2f}"


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rng, texts = random.Random(0), sentences()
    plans = {
        "full32": batches(rng, texts, 200, [32]),
        "mixed1-32": batches(rng, texts, 200, list(range(1, 33))),
    }
    for precision in ("fp32", "bf16"):
        p = load_predictor(sys.argv[1], "cpu", precision)
        for multiple in (None, 16):
            for name, plan in plans.items():
                print(
                    f"{precision:5} pad {multiple or '-':>2} {name:10} {measure(p, plan, multiple)}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
