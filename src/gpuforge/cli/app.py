"""The `gpuforge` Typer app that every verb joins, the consoles, exit codes and options the verbs share,
and how a verb that serves HTTP says where it listens."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Train, compress and serve deep-learning models fast, and know what each run costs.",
)
console = Console(stderr=True)
out_console = Console() if sys.stdout.isatty() else Console(width=120)  # logs and pipes: no squeeze

EXIT_BAD_INPUT, EXIT_FAILED, EXIT_PAUSED = 2, 1, 3

# options several verbs share
SpecPath = Annotated[Path, typer.Argument(help="job spec (YAML)")]
MaxSteps = Annotated[int | None, typer.Option("--max-steps", min=1, help="override train.max_steps")]
Overrides = Annotated[list[str] | None, typer.Option("--set", help="override a field: --set train.lr=1e-3")]


@app.callback()
def _everywhere(
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            envvar="GPUFORGE_VERBOSE",  # settings.py: `verbose`; click refuses a word it does not know
            help="also show third-party warnings, log lines and progress bars",
        ),
    ] = False,
) -> None:
    """Runs before every verb, so before torch, transformers and the rest are imported."""
    from gpuforge.quiet import quiet_third_party

    if verbose:  # for the processes this one starts (ranks, a server's runners) too, and models/hf.py here
        from gpuforge.settings import as_environment

        os.environ.update(as_environment(verbose=True))
    else:
        quiet_third_party()


def run_announced(asgi_app, name: str, host: str, port: int, what: str, **options) -> None:
    """uvicorn.run, saying in one line where it listens once the socket is bound (a bind that fails is
    uvicorn's own error line) and in one line that it stopped, before uvicorn re-raises the signal."""
    import sys

    import uvicorn

    class Announced(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                out_console.print(
                    f"gpuforge {name}: listening on {_url(self.servers[0].sockets[0])} ({what})",
                    highlight=False, markup=False, soft_wrap=True,
                )  # fmt: skip

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            out_console.print(f"gpuforge {name}: stopped", highlight=False, markup=False)

    server = Announced(uvicorn.Config(asgi_app, host=host, port=port, log_level="warning", **options))
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: stopped as asked, as with SIGTERM
        pass
    if not server.started:
        sys.exit(3)  # what uvicorn.run exits with when it could not start


def _url(sock) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
