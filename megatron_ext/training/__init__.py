"""Builders for model / optimizer / data, the train step, logging, checkpointing."""
