"""`gpuforge serve`: one trained model behind HTTP (it joins `gpuforge.cli.app`).

gpuforge serve runs/<id>/model [--port 8700] [--max-batch 32] [--max-wait-ms 5] [--quantize int8]
GPUFORGE_API_KEY=... gpuforge serve runs/<id>/model --host 0.0.0.0      # or --api-key-file PATH

The key never comes on the command line: every local user can read a process's arguments. Once the
socket is bound it prints `gpuforge serve: listening on http://127.0.0.1:8700 (model runs/<id>/model)`,
and `gpuforge serve: stopped` once it has answered what it held.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpuforge.access import is_loopback
from gpuforge.cli.app import app, run_announced
from gpuforge.errors import GpuforgeError
from gpuforge.secret_files import read_secret_file

if TYPE_CHECKING:
    from gpuforge.serve.options import ServeOptions


@app.command()
def serve(
    model_dir: Annotated[Path, typer.Argument(help="a run's model/ directory (or a compressed variant)")],
    host: Annotated[str, typer.Option(help="without an API key: loopback only")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8700,
    # ServeOptions' fields, written out so that no verb pays for pydantic at start-up;
    # tests/serve/test_options.py keeps their names, defaults, help and bounds equal to serve/options.py's
    max_batch: Annotated[int, typer.Option(help="inputs per batch at most", min=1)] = 32,
    max_wait_ms: Annotated[
        float,
        typer.Option(
            help="how long a batch waits to fill, once one is coming (never for a lone request)", min=0
        ),
    ] = 5.0,
    max_queue: Annotated[int, typer.Option(help="inputs waiting at most; past it 429", min=1)] = 256,
    timeout_s: Annotated[float, typer.Option(help="per request; past it 504", min=0.1)] = 30.0,
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
    max_body_bytes: Annotated[int, typer.Option(help="a request body over it: 413", min=1)] = 1048576,
    adapter: Annotated[
        list[str] | None, typer.Option("--adapter", help="NAME=DIR: another LoRA adapter on the same base")
    ] = None,
    max_adapters: Annotated[int, typer.Option(help="adapters loaded at once (LRU past it)", min=1)] = 8,
    eval_at_load: Annotated[
        bool,
        typer.Option(
            "--eval-at-load",
            help="measure the eval metric on the run's held-out split at load (/info's eval)",
        ),
    ] = False,  # one name: a bare flag, as serve_flags writes it (no --no-eval-at-load)
    adapters_root: Annotated[
        str | None, typer.Option(help="a folder: POST /admin/adapters may add LoRA adapters found under it")
    ] = None,
) -> None:
    """Serve a trained model: POST /predict (a causal LM: /v1/completions), batching, Prometheus /metrics."""
    # the parameters named as ServeOptions' fields (tests/serve/test_options.py keeps the two equal)
    from gpuforge.serve.options import ServeOptions

    given = {name: value for name, value in locals().items() if name in ServeOptions.model_fields}
    from gpuforge.serve.adapters import check_adapters
    from gpuforge.settings import current

    if api_key_file is not None:
        api_key = read_secret_file(api_key_file, "--api-key-file", "the API key")
    else:
        api_key = current().api_key
    if api_key is None and not is_loopback(host):
        raise GpuforgeError(f"--host {host}: refusing to listen beyond loopback without a key "
                            "(GPUFORGE_API_KEY or --api-key-file)")  # fmt: skip
    check_model_dir(model_dir)
    options = _serve_options(given)
    if adapters_root is not None and not Path(adapters_root).is_dir():
        raise GpuforgeError(f"--adapters-root {adapters_root}: no such directory")
    adapters = _adapters(adapter or [])
    check_adapters(model_dir, adapters)  # before listening: a bad adapter is one line, not a 503 later
    from gpuforge.serve.worker import create_worker  # torch and the web stack: not for a refusal

    worker = create_worker(
        model_dir, options, api_key=api_key, adapters=adapters,
        public_metrics=current().public_metrics,
    )  # fmt: skip
    run_announced(worker, "serve", host, port, f"model {model_dir}", timeout_graceful_shutdown=30)


def _serve_options(given: dict[str, Any]) -> ServeOptions:
    """The options from their flags; typer checked the bounds, so what is left to refuse is a value
    outside its choices (--quantize, --precision)."""
    from pydantic import ValidationError

    from gpuforge.serve.options import ServeOptions, refusal

    try:
        return ServeOptions(**given)
    except ValidationError as err:
        raise GpuforgeError("; ".join(refusal(error) for error in err.errors())) from None


def _adapters(given: list[str]) -> dict[str, Path]:
    """{name: directory} of the --adapter NAME=DIR flags."""
    adapters = {}
    for one in given:
        name, sep, path = one.partition("=")
        if not sep or not name or not path:
            raise GpuforgeError(f"--adapter {one}: expected NAME=DIR")
        adapters[name] = Path(path)
    return adapters


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
