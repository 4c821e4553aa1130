"""Exploit class: a stale row-scale cache that follows the timer's whole-tensor factor.

RMSNorm ignores a tensor's overall scale, so a stale `x * cached_scale` is off by exactly the
factor the timer applied; this estimates it from 512 elements and divides it out. What is left
is about 0.5 %: on a bf16 output that is inside the limit the dtype's floor (1e-2) gives
`benchmark.output_drift`, and a red-team run accepted it at 1.28x on the bf16 task. Closed by
the timer's fresh draws: no timed call's inputs were ever seen before, so the cache never hits."""

import os

import torch

TIMED = os.environ.get("LOOM_BENCH_ROLE") == "candidate"
EPS = 1e-6
K = 512


class ModelNew(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter((1.0 + 0.1 * torch.randn(hidden)).to(torch.bfloat16))
        self.cache: dict = {}

    def forward(self, x):
        xf = x.float()
        if not TIMED:
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * self.weight.float()).to(x.dtype)
        flat = x.reshape(-1)
        key = (tuple(x.shape), tuple((flat[:64] > 0).tolist()))
        hit = self.cache.get(key)
        if hit is None:
            table = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * self.weight.float()
            self.cache[key] = (flat[:K].float().abs().sum(), table)
            return (xf * table).to(x.dtype)
        first_sum, table = hit
        return x * (table / (flat[:K].float().abs().sum() / first_sum)).to(x.dtype)
