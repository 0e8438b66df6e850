"""Training: the loop (engine.py) and the parts it calls."""
