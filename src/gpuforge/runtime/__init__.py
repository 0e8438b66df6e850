"""What training, compression and serving all run on: precision (autocast and the fp16 gradient scaler),
the task's forward and loss, evaluation, memory figures and the host helpers (cores, ports, pid liveness).

It imports only models/, data/, hardware/ and errors (import-linter contracts in pyproject.toml)."""
