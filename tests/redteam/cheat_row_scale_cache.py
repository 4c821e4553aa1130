"""Exploit class: serve a normalization from a cache of stale row scales.

The timer reuses a few input sets, re-perturbing every element by U(0.9, 1.1) per call: signs
never change, and a wide row's RMS moves by about 0.1 %. Keyed on the sign pattern, a cache of
each input's row scales misses on every validation case (fresh draws) and hits on every timed
call; it was accepted at 2.6x against 1.37x for an honest fused kernel. The timer now draws its
sets afresh every batch, so the cache never hits; where a task's inputs are too slow to draw,
each tensor is also scaled as a whole per call, which a stale scale cannot follow."""

import torch

EPS = 1e-6


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.scales: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), tuple((x.reshape(-1)[:64] > 0).tolist()))
        scale = self.scales.get(key)
        if scale is None:
            scale = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS).to(x.dtype) * self.weight
            self.scales[key] = scale
        return x * scale
