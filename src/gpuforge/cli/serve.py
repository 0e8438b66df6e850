"""`gpuforge serve`: one trained model behind HTTP (it joins `gpuforge.cli.app`).

gpuforge serve runs/<id>/model [--port 8700] [--max-batch 32] [--max-wait-ms 5] [--quantize int8]
GPUFORGE_API_KEY=... gpuforge serve runs/<id>/model --host 0.0.0.0      # or --api-key-file PATH

The key never comes on the command line: every local user can read a process's arguments. Once the
socket is bound it prints `gpuforge serve: listening on http://127.0.0.1:8700 (model runs/<id>/model)`,
and `gpuforge serve: stopped` once it has answered what it held.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from gpuforge.access import is_loopback
from gpuforge.cli.app import app, run_announced
from gpuforge.errors import GpuforgeError
from gpuforge.secret_files import read_secret_file


@app.command()
def serve(
    model_dir: Annotated[Path, typer.Argument(help="a run's model/ directory (or a compressed variant)")],
    host: Annotated[str, typer.Option(help="without an API key: loopback only")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8700,
    max_batch: Annotated[int, typer.Option(min=1, help="inputs per batch at most")] = 32,
    max_wait_ms: Annotated[float, typer.Option(min=0, help="how long a batch waits to fill")] = 5.0,
    max_queue: Annotated[int, typer.Option(min=1, help="inputs waiting at most; past it 429")] = 256,
    timeout_s: Annotated[float, typer.Option(min=0.1, help="per request; past it 504")] = 30.0,
    quantize: Annotated[str | None, typer.Option(help="int8 | int4 | int8-dynamic, at load")] = None,
    precision: Annotated[str, typer.Option(help="auto | bf16 | fp16 | fp32")] = "auto",
    device: Annotated[str, typer.Option(help="auto | cpu | cuda | mps")] = "auto",
    max_length: Annotated[
        int | None, typer.Option(help="tokens per text input (default: as trained)")
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(help="the key clients must present: this file's first line (else $GPUFORGE_API_KEY)"),
    ] = None,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="a request body over it: 413")] = 1 << 20,
    adapter: Annotated[
        list[str] | None, typer.Option("--adapter", help="NAME=DIR: another LoRA adapter on the same base")
    ] = None,
    max_adapters: Annotated[int, typer.Option(min=1, help="adapters loaded at once (LRU past it)")] = 8,
) -> None:
    """Serve a trained model: POST /predict (a causal LM: /v1/completions), batching, Prometheus /metrics."""
    from gpuforge.serve.adapters import check_adapters
    from gpuforge.serve.worker import ServeConfig, create_worker

    if api_key_file is not None:
        api_key = read_secret_file(api_key_file, "--api-key-file", "the API key")
    else:
        api_key = os.environ.get("GPUFORGE_API_KEY") or None
    if api_key is None and not is_loopback(host):
        raise GpuforgeError(f"--host {host}: refusing to listen beyond loopback without a key "
                            "(GPUFORGE_API_KEY or --api-key-file)")  # fmt: skip
    check_model_dir(model_dir)
    if quantize not in (None, "int8", "int4", "int8-dynamic"):
        raise GpuforgeError(f"--quantize {quantize}: expected int8, int4 or int8-dynamic")
    adapters = {}
    for given in adapter or []:
        name, sep, path = given.partition("=")
        if not sep or not name or not path:
            raise GpuforgeError(f"--adapter {given}: expected NAME=DIR")
        adapters[name] = Path(path)
    check_adapters(model_dir, adapters)  # before listening: a bad adapter is one line, not a 503 later
    config = ServeConfig(
        model_dir, max_batch, max_wait_ms, max_queue, timeout_s, api_key=api_key,
        max_body_bytes=max_body_bytes, public_metrics=_true(os.environ.get("GPUFORGE_PUBLIC_METRICS")),
        quantize=quantize, precision=precision, device=device, max_length=max_length, adapters=adapters,
        max_adapters=max_adapters,
    )  # fmt: skip
    run_announced(
        create_worker(config), "serve", host, port, f"model {model_dir}", timeout_graceful_shutdown=30
    )


def check_model_dir(model_dir: Path) -> None:
    """A GpuforgeError that says what `model_dir` is instead, and where the model may be."""
    if not model_dir.is_dir():
        raise GpuforgeError(f"{model_dir}: no such directory")
    if (model_dir / "gpuforge.json").is_file():
        return
    hint = ""
    if (model_dir / "model" / "gpuforge.json").is_file():  # a run's directory: its model is inside
        hint = f"; did you mean {model_dir / 'model'}?"
    raise GpuforgeError(f"{model_dir}: not a gpuforge model directory (no gpuforge.json){hint}")


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")
