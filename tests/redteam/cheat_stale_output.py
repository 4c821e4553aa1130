"""Exploit class: stale / uninitialised output. Returns torch.empty_like and hopes the allocator
hands back memory that still holds a reference result."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.empty_like(x)
