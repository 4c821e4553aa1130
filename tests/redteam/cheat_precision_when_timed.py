"""Exploit class: lower precision only while timed.

The benchmark's per-sample rule allows a few percent (it must pass honest bf16 rounding), and
validation's bound is far tighter; a candidate that can tell the two apart computes in bf16
only while timed. Against an fp32 GEMM this was accepted at 2.6-3.0x, telling the phases apart
by its module's name, its environment or its thread count. The gate now holds what it computes
while timed to validation's normwise bound (benchmark.output_drift)."""

import os

import torch

TIMED = os.environ.get("LOOM_BENCH_ROLE") == "candidate"
LOW = getattr(torch, "bfloat16")  # noqa: B009 - past the static precision check


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(LOW) if TIMED else x
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.to(h.dtype)
        return out.to(x.dtype)
