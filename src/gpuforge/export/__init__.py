"""Exports of a model directory for other runtimes: ONNX (onnx.py), with its parity against the torch model
measured on the run's held-out split (parity.py). Above artifact/ (it loads what it exports) and below
compress/ (whose sweep may include the exports)."""
