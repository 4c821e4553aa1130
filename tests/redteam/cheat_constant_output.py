"""Exploit class: a constant output. 1/cols everywhere is the mean of every softmax row (rows even
sum to one), and within atol of every probability when the row is wide."""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, 1.0 / x.shape[-1])
