"""Exploit class: a degenerate output. Every probability of a wide softmax is below the fp32
atol (1e-4), so all zeros meet |out - ref| <= atol + rtol |ref| on every element."""

import torch


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)
