"""gpuforge: train, compress and serve deep-learning models fast, and know what each run costs."""

__version__ = "0.1.0"
