"""GPU: 2:4 sparsity and int8 against dense bf16 on a 1B-class stack of Linear layers, side by side.

    python benchmarks/gpu_compress.py [--layers 8] [--width 4096] [--tokens 4096] [--json out.json]

The stack: `--layers` FFN blocks of Linear(width, 4 x width) -> GELU -> Linear(4 x width, width), bf16,
random weights (8 x 4096 gives 1.07 B parameters). Each variant is made from the same dense stack with
gpuforge's compress functions and timed on one batch of `--tokens` rows, CUDA events, median of 20 runs
after 5 warm-ups; every variant's time is divided by the dense time measured in the same run.

  dense        bf16, as trained
  2:4          magnitude_prune(..., "2:4") then to_semi_structured (cuSPARSELt / CUTLASS kernels)
  int8         torchao weight-only int8 (quantize_model(..., "int8"))
  int8-dynamic torchao int8 weights and int8 activations (quantize_model(..., "int8-dynamic"))

Needs CUDA; prints one line per variant and `gpu_compress ...` summary lines for scripts/gpu_check.sh.
A variant whose kernels are missing on this GPU or build prints why and the others go on.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuforge.compress.prune import magnitude_prune, to_semi_structured  # noqa: E402
from gpuforge.weights.quantize import quantize_model, tensor_bytes  # noqa: E402


def stack(layers: int, width: int) -> nn.Sequential:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*blocks, nn.Linear(width, width))  # a last layer, the "head", left dense by pruning


def time_ms(model: nn.Module, x: torch.Tensor, runs: int = 20) -> float:
    with torch.inference_mode():
        for _ in range(5):
            model(x)
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_compress: needs CUDA")
        sys.exit(1)
    torch.manual_seed(0)
    dense = stack(args.layers, args.width).to("cuda", torch.bfloat16).eval()
    params = sum(p.numel() for p in dense.parameters())
    x = torch.randn(args.tokens, args.width, device="cuda", dtype=torch.bfloat16)
    base_ms = time_ms(dense, x)
    results = {"params": params, "dense_ms": base_ms, "variants": {}}
    device = torch.cuda.get_device_name()
    print(f"{device}: {params / 1e9:.2f} B params, {args.tokens} tokens, dense {base_ms:.2f} ms")

    def pruned_2_4(model):
        result = magnitude_prune(model, 0.5, "2:4")
        left = to_semi_structured(model, result.pruned)
        if len(left) == len(result.pruned):
            raise RuntimeError(f"no layer took the sparse kernels: {next(iter(left.values()))}")
        return model

    makers = {
        "2:4": pruned_2_4,
        "int8": lambda m: (quantize_model(m, "int8"), m)[1],
        "int8-dynamic": lambda m: (quantize_model(m, "int8-dynamic"), m)[1],
    }
    for name, make in makers.items():
        try:
            model = make(copy.deepcopy(dense))
            ms = time_ms(model, x)
            ratio = base_ms / ms
            gigabytes = tensor_bytes(model) / 1e9
            results["variants"][name] = {"ms": ms, "speedup": ratio, "weight_gb": gigabytes}
            print(
                f"gpu_compress {name:<13} {ms:8.2f} ms   speed-up x{ratio:.2f}   weights {gigabytes:.2f} GB"
            )
            del model
        except Exception as err:  # a missing kernel on this GPU/build: say so, go on
            results["variants"][name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"gpu_compress {name:<13} failed: {type(err).__name__}: {str(err)[:200]}")
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
