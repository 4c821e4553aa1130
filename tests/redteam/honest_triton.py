"""Honest: a one-pass Triton RMSNorm, one program per row, masked tail."""

import torch
import triton
import triton.language as tl


@triton.jit
def rmsnorm_row_kernel(x_ptr, w_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    tl.store(out_ptr + row * dim + cols, x * inv * w, mask=mask)


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        rows, dim = x.shape
        rmsnorm_row_kernel[(rows,)](x, self.weight, out, dim, 1e-6, BLOCK=triton.next_power_of_2(dim))
        return out
