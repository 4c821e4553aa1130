"""CHEAT (demo): the fused Triton RMSNorm with the classic tail bug, the mean over the padded block.

The row is loaded into a power-of-two block with the tail masked to zero, and the sum of squares
is divided by BLOCK_SIZE instead of the row width. On power-of-two hidden sizes (Llama-3-8B's
4096) the two are equal and the kernel is exact, so a harness that only tries 4096 passes it.
On any other width the rstd is scaled by sqrt(BLOCK_SIZE / hidden): +26 % at hidden 5120
(block 8192), +1.2 % at 4000 (block 4096). A proper judge's tail shapes reject it.

Runs the kernel on GPU tensors or under TRITON_INTERPRET=1; otherwise the same bug in torch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    # Round to nearest even on every device (Triton's CPU interpreter truncates fp32 -> bf16).
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def rmsnorm_padded_mean_kernel(x_ptr, weight_ptr, out_ptr, n_cols, eps, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    in_row = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * n_cols + cols, mask=in_row, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / BLOCK_SIZE  # the bug: should divide by n_cols
    rstd = tl.rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    y = round_to(x * rstd * weight, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * n_cols + cols, y, mask=in_row)


class ModelNew(torch.nn.Module):
    def __init__(self, hidden_size: int = 4096, eps: float = 1e-5) -> None:
        super().__init__()
        weight = (1.0 + 0.1 * torch.randn(hidden_size)).to(torch.bfloat16).float()
        self.weight = torch.nn.Parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.shape[-1]
        block_size = triton.next_power_of_2(hidden)
        rows = x.reshape(-1, hidden).contiguous()
        if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            padded_mean = rows.float().pow(2).sum(-1, keepdim=True) / block_size
            y = rows.float() * torch.rsqrt(padded_mean + self.eps) * self.weight.float()
            return y.to(x.dtype).reshape(x.shape)
        out = torch.empty_like(rows)
        rmsnorm_padded_mean_kernel[(rows.shape[0],)](
            rows, self.weight, out, hidden, self.eps, BLOCK_SIZE=block_size
        )
        return out.reshape(x.shape)


if __name__ == "__main__":
    for hidden in (256, 320):
        model = ModelNew(hidden)
        x = torch.randn(2, hidden)
        exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * model.weight
        error = ((model(x) - exact).abs().max() / exact.abs().max()).item()
        print(f"hidden {hidden}: max relative error {error:.3f}")
