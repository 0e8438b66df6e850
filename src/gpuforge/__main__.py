"""`python -m gpuforge ...` is the same as the `gpuforge` command."""

from gpuforge.cli import main

main()
