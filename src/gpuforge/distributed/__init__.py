"""Distributed (data-parallel) training helpers: gradient compression hooks for DDP."""

from gpuforge.distributed.grad_compression import KINDS, CommCounter, CompressionState, make_hook

__all__ = ["KINDS", "CommCounter", "CompressionState", "make_hook"]
