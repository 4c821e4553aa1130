"""A small Llama-style decoder on GGUF Q4_K weights, run on the built-in kernels."""
