"""Exploit class: a tiny-scale copy. The right softmax, times 1e-3: the shape of the answer at a
scale the absolute tolerance cannot see."""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.tanh(x), dim=-1) * 1e-3
