"""MFU of a LoRA job on a ~1B-parameter model, on a CUDA device (run by scripts/gpu_check.sh).

    python benchmarks/gpu_mfu.py [--steps 30] [--json out.json]

A Llama-shaped transformers config of about 1.1B parameters is written locally and built with random
weights (`model.pretrained: false`; nothing is downloaded), then trained as a causal LM with LoRA (r=16
on the attention and MLP projections) in bf16 on this Python's stdlib docstrings, byte-level tokens,
sequences of 1024. gpuforge's own metrics give the MFU (4 x params x tokens for a frozen base, over the
measured bf16 matmul peak). Floor: 40%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from gpuforge.spec import parse_spec  # noqa: E402
from gpuforge.train.engine import train  # noqa: E402

FLOOR = 0.40
CONFIG = {  # ~1.1B parameters with a 257-token byte vocabulary
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 257,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 256,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_mfu: skipped, no CUDA device")
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama-1b"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(CONFIG))
        raw = {
            "name": "lora-1b",
            "model": {"source": f"hf:{model_dir}", "task": "causal-lm", "pretrained": False},
            "data": {
                "train": "stdlib:docstrings",
                "max_length": 1024,
                "tokenizer": "bytes",
                "eval_fraction": 0,
            },
            "adapt": {
                "lora": {
                    "r": 16,
                    "alpha": 32,
                    "target_modules": [
                        "q_proj",
                        "k_proj",
                        "v_proj",
                        "o_proj",
                        "gate_proj",
                        "up_proj",
                        "down_proj",
                    ],
                }
            },
            "train": {
                "max_steps": args.steps,
                "batch_size": 16,
                "global_batch_size": 16,
                "precision": "bf16",
                "lr": 1e-4,
                "log_every": 1,
            },
        }
        summary = train(parse_spec(raw, Path(tmp)), Path(tmp) / "run")
        metrics = [
            json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        ]
    steady = metrics[5:]  # after warm-up
    mfu = statistics.median(m["mfu"] for m in steady)
    tokens = statistics.median(m["tokens_per_s"] for m in steady)
    params, trainable = summary["parameters"] / 1e9, summary["trainable_parameters"] / 1e6
    peak_tflops, peak_mem = summary["device_peak_flops"] / 1e12, summary["peak_mem_bytes"] / 2**30
    print(
        f"model {params:.2f}B params ({trainable:.1f}M trainable), "
        f"peak {peak_tflops:.0f} TFLOP/s measured (bf16)"
    )
    verdict = "PASS" if mfu >= FLOOR else "BELOW"
    print(
        f"gpu_mfu: median MFU {mfu:.1%}  tokens/s {tokens:,.0f}  peak mem {peak_mem:.1f} GiB  "
        f"floor {FLOOR:.0%}  {verdict}"
    )
    if args.json:
        args.json.write_text(json.dumps({"mfu": mfu, "tokens_per_s": tokens, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
