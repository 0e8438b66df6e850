"""Compression of a trained model: prune, quantize, merge, and a report of what each changed."""
