"""Exploit class: NaN output. Skips rows it finds awkward and leaves NaN there."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        out[x.abs().amax(-1) > 2.5] = float("nan")
        return out
