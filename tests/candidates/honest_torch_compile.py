"""Honest candidate: RMSNorm with a torch.compile'd row statistic and a Triton kernel that
scales the rows. torch.compile (dynamo + inductor) uses exec, compile, generated modules,
threads and, on CPU, ctypes: all from torch's own frames, which the worker's audit hook allows."""

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_rows_kernel(x_ptr, inv_ptr, w_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    inv = tl.load(inv_ptr + row)
    tl.store(out_ptr + row * n_cols + cols, x * inv * w, mask=mask)


@torch.compile(dynamic=False)
def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


class ModelNew(nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        inv = inverse_rms(x, 1e-6).contiguous()
        out = torch.empty_like(x)
        rows, dim = x.shape
        scale_rows_kernel[(rows,)](x, inv, self.weight, out, dim, BLOCK=triton.next_power_of_2(dim))
        return out
