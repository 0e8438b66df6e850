"""`gpuforge serve`: one trained model behind HTTP (it joins `gpuforge.cli.app`).

gpuforge serve runs/<id>/model [--port 8700] [--max-batch 32] [--max-wait-ms 5] [--quantize int8]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from gpuforge.cli import app
from gpuforge.errors import GpuforgeError
from gpuforge.server.access import is_loopback


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
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="required from clients ($GPUFORGE_API_KEY)")
    ] = None,
    adapter: Annotated[
        list[str] | None, typer.Option("--adapter", help="NAME=DIR: another LoRA adapter on the same base")
    ] = None,
    max_adapters: Annotated[int, typer.Option(min=1, help="adapters loaded at once (LRU past it)")] = 8,
) -> None:
    """Serve a trained model: POST /predict, dynamic batching, Prometheus /metrics."""
    import uvicorn

    from gpuforge.serve.adapters import check_adapters
    from gpuforge.serve.worker import ServeConfig, create_worker

    api_key = api_key or os.environ.get("GPUFORGE_API_KEY") or None
    if api_key is None and not is_loopback(host):
        raise GpuforgeError(f"--host {host}: refusing to listen beyond loopback without --api-key")
    if not (model_dir / "gpuforge.json").is_file():
        raise GpuforgeError(f"{model_dir}: not a gpuforge model directory (no gpuforge.json)")
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
        model_dir, max_batch, max_wait_ms, max_queue, timeout_s, api_key=api_key, quantize=quantize,
        precision=precision, device=device, max_length=max_length, adapters=adapters,
        max_adapters=max_adapters,
    )  # fmt: skip
    uvicorn.run(
        create_worker(config), host=host, port=port, log_level="warning", timeout_graceful_shutdown=30
    )
