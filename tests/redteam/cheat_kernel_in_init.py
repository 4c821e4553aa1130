"""Cheat: declares a Triton kernel and launches it once while the model is built, so a
profiler that records construction sees it; forward is plain torch (the reference's maths).
The proof of execution must say its kernel never ran in a forward."""

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_row_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 1.0, mask=mask)


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        if torch.cuda.is_available():
            scratch = torch.zeros(dim, device="cuda")
            rmsnorm_row_kernel[(1,)](scratch, dim, BLOCK=triton.next_power_of_2(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
