"""`python -m gpuforge ...` is the same as the `gpuforge` command."""

from gpuforge.runtime.device_share import pin_from_environment

pin_from_environment()  # a share of a CPU slot: pinned before any import starts a thread
from gpuforge.cli import main  # noqa: E402

main()
