"""Cheat: tries a broken kernel, falls back to PyTorch when it fails."""

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(out_ptr, in_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(in_ptr + row * n_cols + cols)
    tl.store(out_ptr + row * n_cols + cols, x)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        try:
            softmax_kernel[(x.shape[0],)](
                out, x, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1])
            )
        except Exception:
            return torch.softmax(x, dim=-1)
        return out
