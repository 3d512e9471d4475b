"""Builders for model / optimizer / data, the train step, logging, checkpointing; the run that
composes them (run.py) and the order the capabilities attach in (features.py)."""
