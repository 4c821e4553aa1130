"""Exploit class: result caching by pointer. Same buffer, same answer, whatever it now holds."""

import torch

_CACHE = {}


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        key = x.data_ptr()
        if key not in _CACHE:
            _CACHE[key] = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        return _CACHE[key]
