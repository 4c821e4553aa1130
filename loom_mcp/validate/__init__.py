"""Correctness: reading task files, static checks on candidates, and the validation harness."""
