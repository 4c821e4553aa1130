"""Residual add fused with the RMSNorm that follows it: h = x + delta, y = rmsnorm(h) * weight.

A decoder layer adds a sublayer's output to the residual stream and normalizes the sum for the
next sublayer. Unfused that is two kernels (the add, then the norm re-reading the sum); at
decode, with one 4096-wide row, each is all launch and no bandwidth, so the model program does
both in one: each program reads a row of x and of delta once, writes h and y once.

Numerics match the unfused pair: h is rounded to the activation dtype as PyTorch's add rounds
it, and the norm is taken of that rounded h, in fp32, with one rounding at the store (the
rmsnorm kernel's arithmetic).

Self-check: `TRITON_INTERPRET=1 python -m kernels.llama_q4k.add_rmsnorm`, or on a GPU without
the variable.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.rmsnorm.rmsnorm import MAX_FUSED_ROW
from kernels.silu_mul.silu_mul import gdc_launch_dependents, gdc_wait, pdl_launch, round_to


@triton.jit
def add_rmsnorm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    h_ptr,
    y_ptr,
    n_cols,
    eps,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,
    WEIGHT_BEFORE_WAIT: tl.constexpr = False,
):
    if PDL:  # see pdl_launch: the GEMV after this one may start streaming its weights
        gdc_launch_dependents()
        if not WEIGHT_BEFORE_WAIT:
            gdc_wait()
    # One program per row: the rows here are decode's handful, or prefill's, a few hundred.
    row = tl.program_id(0).to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK_SIZE)
    in_row = cols < n_cols
    # All three loads first: at decode the kernel is one row, all latency, and the weight's
    # load would otherwise wait behind the reduction.
    weight = tl.load(weight_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    if PDL and WEIGHT_BEFORE_WAIT:
        gdc_wait()  # x and delta are earlier kernels' outputs; a constant weight is not
    x = tl.load(x_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)
    delta = tl.load(delta_ptr + row + cols, mask=in_row, other=0.0).to(tl.float32)
    h = round_to(x + delta, h_ptr.dtype.element_ty)
    tl.store(h_ptr + row + cols, h, mask=in_row)
    h = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    tl.store(y_ptr + row + cols, round_to(h * rstd * weight, y_ptr.dtype.element_ty), mask=in_row)


def torch_add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused pair, in plain PyTorch: the reference and the CPU path."""
    h = x + delta
    h32 = h.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return h, y.to(h.dtype)


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    constant_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rmsnorm(x + delta) * weight), both in x's dtype, from one kernel.

    `constant_weight`: the caller promises no kernel writes the weight, so under PDL it loads
    before the wait for the kernels before this one."""
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return torch_add_rms_norm(x, delta, weight, eps)
    hidden = x.shape[-1]
    if hidden > MAX_FUSED_ROW or delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm needs delta shaped and typed as x ({tuple(x.shape)} {x.dtype}) and "
            f"rows of at most {MAX_FUSED_ROW}; got {tuple(delta.shape)} {delta.dtype}"
        )
    x_rows, delta_rows = x.reshape(-1, hidden).contiguous(), delta.reshape(-1, hidden).contiguous()
    h, y = torch.empty_like(x_rows), torch.empty_like(x_rows)
    if x_rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        add_rmsnorm_kernel[(x_rows.shape[0],)](
            x_rows,
            delta_rows,
            weight,
            h,
            y,
            hidden,
            eps,
            BLOCK_SIZE=block,
            num_warps=min(max(block // 1024, 1), 16),
            WEIGHT_BEFORE_WAIT=constant_weight,
            **pdl_launch(x_rows),
        )
    return h.reshape(x.shape), y.reshape(x.shape)


def example_calls():
    """Launches at Llama-3-8B's shapes (decode, a decode batch, prefill), for the compile test."""
    weight = torch.ones(4096)
    for rows, dtype in ((1, torch.bfloat16), (8, torch.float16), (512, torch.bfloat16)):
        x = torch.zeros(rows, 4096, dtype=dtype)
        yield lambda x=x: add_rms_norm(x, x, weight, 1e-5)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for rows, hidden, dtype in [(1, 256, torch.bfloat16), (5, 300, torch.float16), (3, 96, torch.float32)]:
        x = torch.randn(rows, hidden, dtype=dtype, device=device)
        delta = torch.randn(rows, hidden, dtype=dtype, device=device)
        weight = 1.0 + 0.1 * torch.randn(hidden, device=device)
        want_h, want_y = torch_add_rms_norm(x, delta, weight, 1e-5)
        got_h, got_y = add_rms_norm(x, delta, weight, 1e-5)
        assert torch.equal(got_h, want_h), "the sum differs from PyTorch's add"
        torch.testing.assert_close(got_y.double(), want_y.double(), atol=1e-2, rtol=1e-2)
    print(f"add_rms_norm ({'triton' if device == 'cuda' or os.environ.get('TRITON_INTERPRET') == '1' else 'torch'} on {device}): ok")
