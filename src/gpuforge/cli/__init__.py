"""The `gpuforge` command: one verb a function, each a thin call into the modules that do the work.

    gpuforge train SPEC.yaml [--out DIR] [--max-steps N] [--set key=value]...
    gpuforge demo [--examples DIR] [--out DIR] [--max-steps N] [--local]
    gpuforge plan SPEC.yaml [--measure]
    gpuforge compress RUN/model [--merge] [--prune F --prune-structure S] [--quantize K] --out DIR
    gpuforge compress RUN/model --sweep --out DIR
    gpuforge export RUN/model --format onnx --out DIR [--quantize int8] [--opset N]
    gpuforge hw
    gpuforge tune SPEC [--local --out DIR] | tune show ID|DIR | tune stop ID|DIR | tunes  (cli/tune.py)
    gpuforge profile RUN                                 (a run trained with --profile START:STEPS)
    gpuforge server | submit | jobs | job | logs | cancel | resume | wait | keys      (cli/server.py)
    gpuforge notifications [add | targets | remove | test]                         (cli/notifications.py)
    gpuforge serve RUN/model [--port 8700] [--max-batch 32] [--max-wait-ms 5]        (cli/serve.py)
    gpuforge login [--server URL] [--browser] | logout [--server URL]                 (cli/login.py)

Bad input is one line on stderr and exit code 2; a training failure (NaN loss) exits 1; a run paused by
its cost budget exits 3; a run stopped by SIGINT/SIGTERM exits 130/143 after its checkpoint.
"""

from __future__ import annotations

import sys

from gpuforge.cli import deployments, local, login, notifications, profile, serve, server, tune  # noqa: F401  (each module's verbs join `app`)
from gpuforge.cli.app import EXIT_BAD_INPUT, EXIT_FAILED, app, console
from gpuforge.errors import GpuforgeError, TrainingFailed

__all__ = ["app", "main"]


def main() -> None:
    import logging

    from rich.logging import RichHandler

    logger = logging.getLogger("gpuforge")
    logger.setLevel(logging.INFO)
    logger.addHandler(RichHandler(console=console, show_time=False, show_path=False, markup=False))
    try:
        app()
    except TrainingFailed as err:
        console.print(f"gpuforge: training failed: {err}", highlight=False, markup=False)
        sys.exit(EXIT_FAILED)
    except GpuforgeError as err:
        console.print(f"gpuforge: error: {err}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        console.print("gpuforge: interrupted", highlight=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
