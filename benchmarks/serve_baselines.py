"""What benchmarks/serve_load.py sets `gpuforge serve` against: two servers and the no-server ceiling.

    python benchmarks/serve_baselines.py plain MODEL_DIR --port P [--threads N]
    python benchmarks/serve_baselines.py litserve MODEL_DIR --port P [--threads N]
    python benchmarks/serve_baselines.py trivial - --port P
    python benchmarks/serve_baselines.py ceiling MODEL_DIR [--seconds 6] [--threads N] [--int8-dynamic]
                                                 [--onnx EXPORT_DIR]

plain: a FastAPI route as a careful user writes it: one forward per request, a sync route (FastAPI runs
it in its thread pool, so the event loop keeps accepting) holding a lock around the model (one forward
at a time: torch already uses every core), torch.inference_mode, uvicorn with uvloop and httptools.
litserve: LitServe (`pip install -e .[bench]`) batching by its LitAPI batch/unbatch with
max_batch_size 32 and batch_timeout 0.005 s, one inference worker, one API server, defaults otherwise.
Both load the model with gpuforge.artifact.load_artifact, tokenize each batch padded to its own longest
input (truncated to the model's max_length) and answer like gpuforge serve:
{"model", "outputs": [{"label", "score", "scores"}]}; both run in fp32 (gpuforge serve --precision fp32).
trivial: the client's own ceiling, a bare ASGI app on the same uvicorn (uvloop, httptools) that reads
each body and answers a fixed classifier-shaped JSON: what load the client drives when the server does
nothing (benchmarks/serve_load.py runs it at every level).
ceiling: samples/s of the model's own batched forward with no server, at batch 32 on the sentences of
examples/data/topics.jsonl tokenized once per batch (padded per batch), under torch.inference_mode, at
fp32, at bf16 as gpuforge serves it (the Linear weights cast once, gpuforge.serve.batch_precision.lowered,
under autocast: the fastest bf16 forward we know here), at bf16 autocast over the fp32 weights (what a
user writes first: "bf16-autocast"), and int8-dynamic through gpuforge.weights.quantize.quantize_model
(what `gpuforge serve --quantize int8-dynamic` runs); also the server's own batch path with no HTTP
(gpuforge.serve.predict.Predictor.run_batch: tokenize, forward, softmax, result dicts) in fp32 and bf16,
and with `--onnx` an ONNX export's (onnxruntime, "run_batch onnx"). Precisions are measured in
alternating rounds and the median round is reported, as JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
TEXTS = ROOT / "examples" / "data" / "topics.jsonl"
MAX_BATCH, BATCH_TIMEOUT_S = 32, 0.005


class Body(BaseModel):
    inputs: list[str]


def sentences() -> list[str]:
    with TEXTS.open() as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


class Model:
    """A model directory loaded as gpuforge loads it, and one batch of texts through it."""

    def __init__(self, model_dir: str, precision: str = "fp32"):
        import torch

        from gpuforge.artifact import load_artifact

        self.torch = torch
        self.module, self.tokenizer, manifest = load_artifact(model_dir, "cpu")
        self.name = manifest.job or "model"
        self.labels = manifest.labels or [str(i) for i in range(manifest.num_labels)]
        self.max_length = manifest.max_length
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "bf16-autocast": torch.bfloat16}[precision]
        if precision == "bf16":  # as gpuforge serves bf16: the Linear weights cast once, not every forward
            from gpuforge.serve.batch_precision import lowered

            self.module = lowered(self.module, torch.bfloat16)

    def encode(self, texts: list[str]) -> dict:
        encoded = self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_length is not None,
            max_length=self.max_length,
            return_tensors="pt",
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def forward(self, batch: dict):
        torch = self.torch
        with torch.inference_mode(), torch.autocast("cpu", self.dtype, enabled=self.dtype is not None):
            return self.module(**batch).logits

    def predict(self, texts: list[str]) -> list[dict]:
        probs = self.torch.softmax(self.forward(self.encode(texts)).float(), dim=-1)
        outputs = []
        for row in probs.tolist():
            best = max(range(len(row)), key=row.__getitem__)
            scores = dict(zip(self.labels, row, strict=True))
            outputs.append({"label": self.labels[best], "score": row[best], "scores": scores})
        return outputs


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def serve_plain(model_dir: str, port: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    model = Model(model_dir)
    model.predict(["warm up"] * 8)
    lock = threading.Lock()
    app = FastAPI()

    @app.post("/predict")
    def predict(body: Body) -> dict:
        with lock:
            outputs = model.predict(body.inputs)
        return {"model": model.name, "outputs": outputs}

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


try:  # the bench extra: pip install -e .[bench]
    import litserve as ls
except ImportError:
    ls = None

if ls is not None:

    class LitModel(ls.LitAPI):
        """At module level: LitServe pickles it into its inference worker (a spawned process)."""

        def __init__(self, model_dir: str, threads: int | None):
            super().__init__(max_batch_size=MAX_BATCH, batch_timeout=BATCH_TIMEOUT_S)
            self.model_dir, self.threads = model_dir, threads

        def setup(self, device):
            set_threads(self.threads)
            self.model = Model(self.model_dir)
            self.model.predict(["warm up"] * 8)

        def decode_request(self, request):
            inputs = request["inputs"]
            return inputs[0] if isinstance(inputs, list) else inputs  # one input per request

        def batch(self, inputs):
            return list(inputs)

        def predict(self, texts):
            return self.model.predict(texts)

        def unbatch(self, output):
            return output

        def encode_response(self, output):
            return {"model": self.model.name, "outputs": [output]}


def serve_litserve(model_dir: str, port: int, threads: int | None) -> None:
    if ls is None:
        sys.exit("litserve is not installed: pip install -e .[bench]")
    server = ls.LitServer(LitModel(model_dir, threads), accelerator="cpu", devices=1, workers_per_device=1)
    server.run(
        host="127.0.0.1", port=port, num_api_servers=1, log_level="warning", generate_client_file=False
    )


def batch_path(predictor):
    """texts -> results by Predictor.run_batch (it takes (adapter, input) pairs since adapters came)."""
    try:
        predictor.run_batch([(None, "probe")])
        return lambda texts: predictor.run_batch([(None, t) for t in texts])
    except (TypeError, ValueError):
        return predictor.run_batch


def serve_trivial(port: int) -> None:
    """A bare ASGI app: the body read, a fixed answer of a classifier's shape sent; nothing else."""
    import uvicorn

    answer = json.dumps({"model": "trivial", "outputs": [{"label": "a", "score": 1.0, "scores": {"a": 1.0}}]})
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    body = {"type": "http.response.body", "body": answer.encode()}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send(start)
        await send(body)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def ceiling(model_dir: str, seconds: float, rounds: int, int8_dynamic: bool, onnx: str | None) -> dict:
    import torch

    from gpuforge.serve.predict import load_predictor

    texts = sentences()
    chunks = [texts[i : i + MAX_BATCH] for i in range(0, len(texts), MAX_BATCH)]
    chunks = [c for c in chunks if len(c) == MAX_BATCH] or chunks
    models = {p: Model(model_dir, p) for p in ("fp32", "bf16", "bf16-autocast")}
    if int8_dynamic:
        from gpuforge.weights.quantize import quantize_model

        models["int8-dynamic"] = Model(model_dir, "fp32")
        quantize_model(models["int8-dynamic"].module, "int8-dynamic")
    batches = [models["fp32"].encode(c) for c in chunks]
    served = {p: batch_path(load_predictor(model_dir, "cpu", p)) for p in ("fp32", "bf16")}
    if onnx:
        served["onnx"] = batch_path(load_predictor(onnx, "cpu", "fp32"))

    def rate(step, items) -> float:
        for item in items:  # warm-up: every shape once (the first pass of a shape pays for set-up)
            step(item)
        done, start = 0, time.perf_counter()
        while True:
            for item in items:
                step(item)
                done += len(item["input_ids"]) if isinstance(item, dict) else len(item)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / rounds:
                return done / elapsed

    figures: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, model in models.items():
            figures.setdefault(name, []).append(rate(model.forward, batches))
        for name, run_batch in served.items():
            figures.setdefault(f"run_batch {name}", []).append(rate(run_batch, chunks))
    return {
        "batch": MAX_BATCH,
        "threads": torch.get_num_threads(),
        "tokens_per_batch": statistics.mean(b["input_ids"].shape[1] for b in batches),
        "samples_per_s": {k: statistics.median(v) for k, v in figures.items()},
        "rounds": figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["plain", "litserve", "trivial", "ceiling"])
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, default=8711)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seconds", type=float, default=6.0, help="ceiling: seconds per precision")
    parser.add_argument("--rounds", type=int, default=3, help="ceiling: alternating rounds")
    parser.add_argument("--int8-dynamic", action="store_true", help="ceiling: also int8-dynamic")
    parser.add_argument("--onnx", help="ceiling: also this ONNX export's batch path (run_batch onnx)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    set_threads(args.threads)
    if args.what == "plain":
        serve_plain(args.model_dir, args.port)
    elif args.what == "litserve":
        serve_litserve(args.model_dir, args.port, args.threads)
    elif args.what == "trivial":
        serve_trivial(args.port)
    else:
        figures = ceiling(args.model_dir, args.seconds, args.rounds, args.int8_dynamic, args.onnx)
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
