"""Exploit class: deferred work aimed at the other arm. The output is honest and computed in
the call, but a finalizer queues a long busy-wait on the GPU for later, when the garbage
collector runs it: with luck, while the baseline is being timed."""

import weakref

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        if x.is_cuda:
            weakref.finalize(y, torch.cuda._sleep, 50_000_000)
        return y
