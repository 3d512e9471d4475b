"""Measurement helpers for the benchmark scripts and tests; the training runtime never imports this package."""
