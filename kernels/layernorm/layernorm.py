"""LayerNorm in Triton, with the residual add before it fused in: one read of each input row, one
write of the sum and one of the normed row.

A pre-norm transformer block (CLIP's and SigLIP's vision towers) adds each sublayer's output to
the residual stream and normalizes the sum straight away. Eager PyTorch does the add, then
LayerNorm's mean and variance passes; here one program holds the row in registers, forms
`x + delta`, writes it (the new residual) and writes `(s - mean) * rstd * weight + bias`.

Statistics are fp32 over the true width (masked lanes add nothing), with one rounding to the
activation dtype at each store.

Where it runs: GPU tensors always take the Triton kernel; CPU tensors take it under
`TRITON_INTERPRET=1` and otherwise `torch.nn.functional.layer_norm` on fp32, the same maths.

Self-check: `TRITON_INTERPRET=1 python -m kernels.layernorm.layernorm`, or on a GPU without it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# One program keeps a whole row in registers; vision towers are at most a few thousand wide.
MAX_FUSED_ROW = 16384


@triton.jit
def add_layernorm_kernel(
    x_ptr,
    delta_ptr,
    sum_ptr,
    out_ptr,
    weight_ptr,
    bias_ptr,
    n_cols,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Rows are contiguous; widen before multiplying so rows past 2^31 elements stay in range.
    row = tl.program_id(0).to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(sum_ptr + row + cols, x.to(sum_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = centered * rstd * weight + bias
    tl.store(out_ptr + row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def torch_add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, layer_norm(x + delta)) in plain PyTorch, fp32 statistics; delta may be None."""
    total = x if delta is None else (x.float() + delta.float()).to(x.dtype)
    normed = torch.nn.functional.layer_norm(total.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return total, normed.to(x.dtype)


def add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, LayerNorm(x + delta)) over the last dimension; with delta None, (x, LayerNorm(x))."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or bias.shape != (hidden,):
        raise ValueError(f"weight and bias must be [{hidden}]; got {tuple(weight.shape)} and {tuple(bias.shape)}")
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {tuple(x.shape)}; got {tuple(delta.shape)}")
    if not _runs_triton(x):
        return torch_add_layer_norm(x, delta, weight, bias, eps)
    weight, bias = weight.contiguous(), bias.contiguous()
    if hidden > MAX_FUSED_ROW:
        raise ValueError(f"row width {hidden} exceeds the one-program limit {MAX_FUSED_ROW}")
    rows = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(rows)
    total = rows
    if delta is not None:
        delta_rows = delta.reshape(-1, hidden).contiguous()
        total = torch.empty_like(rows)
    else:
        delta_rows = rows  # never read: HAS_DELTA is off
    if rows.shape[0]:
        add_layernorm_kernel[(rows.shape[0],)](
            rows,
            delta_rows,
            total,
            out,
            weight,
            bias,
            hidden,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK_SIZE=triton.next_power_of_2(hidden),
            num_warps=min(max(triton.next_power_of_2(hidden) // 256, 1), 16),
        )
    return total.reshape(x.shape), out.reshape(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return add_layer_norm(x, None, weight, bias, eps)[1]


def example_calls():
    """Launches at a CLIP ViT-L/14-336 tower's shapes (577 tokens of 1024), for the compile test."""
    weight, bias = torch.ones(1024), torch.zeros(1024)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.zeros(577, 1024, dtype=dtype)
        yield lambda x=x: add_layer_norm(x, x, weight, bias, 1e-5)
        yield lambda x=x: add_layer_norm(x, None, weight, bias, 1e-5)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if _runs_triton(torch.empty(0, device=device)) else "torch"
    for rows, hidden, dtype in [(1, 64, torch.float32), (7, 300, torch.float16), (577, 1024, torch.bfloat16)]:
        x = torch.randn(rows, hidden, device=device).to(dtype)
        delta = torch.randn(rows, hidden, device=device).to(dtype)
        weight = 1.0 + 0.1 * torch.randn(hidden, device=device)
        bias = 0.1 * torch.randn(hidden, device=device)
        total, normed = add_layer_norm(x, delta, weight, bias, 1e-5)
        exact = x.double() + delta.double()
        expected = torch.nn.functional.layer_norm(exact, (hidden,), weight.double(), bias.double(), 1e-5)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(total.double(), exact, atol=tol, rtol=tol)
        torch.testing.assert_close(normed.double(), expected, atol=tol, rtol=tol)
    print(f"layernorm ({path} path on {device}): ok")
