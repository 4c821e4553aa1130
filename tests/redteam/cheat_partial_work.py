"""Exploit class: partial work. Estimates the mean square from a quarter of each row."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        sample = x[:, ::4]
        return x * torch.rsqrt(sample.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
