"""The parts of text generation (serve/generate.py's GenerationEngine composes them): what a request is
(`request.py`), who runs and when (`scheduler.py`), the batched forward over the KV cache (`model_step.py`),
and sampling, detokenising and streaming to the caller (`output.py`)."""
