"""A linear layer's bias add fused with the GELU after it, in Triton: one read, one write.

A vision tower's MLP is `fc2(act(fc1(x)))`. The matmul runs in cuBLAS; the bias and the
activation are elementwise, so doing them in one pass over fc1's output saves a round trip
through memory (eager PyTorch makes two). Three activations, as the checkpoints name them:

* `erf`   - exact GELU, `0.5 x (1 + erf(x / sqrt 2))` (HF "gelu"; the LLaVA projector's)
* `tanh`  - the tanh approximation (HF "gelu_pytorch_tanh"; SigLIP's)
* `quick` - `x * sigmoid(1.702 x)` (HF "quick_gelu"; OpenAI CLIP's)

Maths in fp32, one rounding at the store. GPU tensors take the Triton kernel; CPU tensors take
it under `TRITON_INTERPRET=1`, otherwise the same formulas in PyTorch.

Self-check: `TRITON_INTERPRET=1 python -m kernels.gelu.gelu`, or on a GPU without it.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

KINDS = ("erf", "tanh", "quick")
BLOCK = 1024


@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, n_elements, n_cols, KIND: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(bias_ptr + offsets % n_cols, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif KIND == 1:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # tanh(u) = 2 sigmoid(2u) - 1, which stays finite for any u
        y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        y = x * tl.sigmoid(1.702 * x)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def torch_bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
    """act(x + bias) in fp32 PyTorch, rounded to x's dtype."""
    y = x.float() if bias is None else x.float() + bias.float()
    if kind == "erf":
        y = torch.nn.functional.gelu(y)
    elif kind == "tanh":
        y = torch.nn.functional.gelu(y, approximate="tanh")
    elif kind == "quick":
        y = y * torch.sigmoid(1.702 * y)
    else:
        raise ValueError(f"GELU kind {kind!r}; one of {', '.join(KINDS)}")
    return y.to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, kind: str = "erf") -> torch.Tensor:
    """act(x + bias) over x's last dimension (bias of that width, or None)."""
    if kind not in KINDS:
        raise ValueError(f"GELU kind {kind!r}; one of {', '.join(KINDS)}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must be [{x.shape[-1]}]; got {tuple(bias.shape)}")
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return torch_bias_gelu(x, bias, kind)
    flat = x.contiguous()
    bias = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device) if bias is None else bias.contiguous()
    out = torch.empty_like(flat)
    n = flat.numel()
    if n:
        bias_gelu_kernel[(math.ceil(n / BLOCK),)](
            flat, bias, out, n, x.shape[-1], KIND=KINDS.index(kind), BLOCK_SIZE=BLOCK
        )
    return out


def example_calls():
    """Launches at a CLIP ViT-L/14-336 tower's MLP and the LLaVA projector, for the compile test."""
    for kind in KINDS:
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.zeros(577, 4096, dtype=dtype)
            yield lambda x=x, kind=kind: bias_gelu(x, torch.zeros(4096, dtype=x.dtype), kind)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for kind in KINDS:
        for rows, cols, dtype in [(3, 100, torch.float32), (577, 4096, torch.bfloat16)]:
            x = (3 * torch.randn(rows, cols, device=device)).to(dtype)
            bias = torch.randn(cols, device=device)
            expected = torch_bias_gelu(x.double(), bias.double(), kind)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(bias_gelu(x, bias, kind).double(), expected, atol=tol, rtol=tol)
    print(f"bias_gelu on {device}: ok")
