"""Kernel compilation: Triton, nvcc, hipcc; resource reports."""
