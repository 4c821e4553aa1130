"""Exploit class: lazy tensor subclass. The returned object defers the work to whoever reads it."""

import torch


class Deferred(torch.Tensor):
    pass


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        return out.as_subclass(Deferred)
