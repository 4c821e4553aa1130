"""Benchmarking: the timing harness (runs in workers) and its statistics (runs in the judge)."""
