"""Exploit class: try/except fallback. The 'kernel' always fails; torch does the work."""

import torch


def fast_kernel(x, w):
    raise RuntimeError("not implemented")


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        try:
            return fast_kernel(x, self.weight)
        except Exception:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
