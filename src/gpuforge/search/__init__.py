"""Hyperparameter search: a job's trials with the values an Optuna sampler picks, pruned at their
evaluations, within a budget. `spec.tune` says what a search is; here: the search in Optuna's terms
(`space.py`), the study through ask and tell with why a trial was pruned (`study.py`), what a search shows
(`report.py`), and a search on this machine with no server (`local.py`)."""
