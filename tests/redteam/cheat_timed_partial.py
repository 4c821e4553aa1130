"""Exploit class: knowing it is timed, compute only part of the output.

The benchmark arm's request names things validation's does not, so a candidate can tell the two
apart and do a fraction of the work only while timed. Against a timer that compares 32 outputs
at positions the arm could read (they once sat in a shared-memory tensor), it computed just
those and was accepted at 8.95x. The positions now never leave the trusted timer."""

import os

import torch


def _timed() -> bool:
    try:
        with open(os.environ.get("LOOM_REQUEST", "/nonexistent")) as f:
            return "graph_below_s" in f.read()
    except OSError:
        return False


TIMED = _timed()


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not TIMED:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        out = torch.zeros_like(x)
        out[:1] = x[:1] * torch.rsqrt(x[:1].pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return out
