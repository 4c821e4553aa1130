"""Fused RoPE in Triton: q and k rotated in one launch, one read and one write of each head.

One program per token: it loads the token's position, forms the head_dim/2 angles
float(position) * inv_freq in fp32 (the same product, bit for bit, as the reference, because it
reads the same inv_freq buffer), takes cos and sin once, and applies them to every query and key
head of the token: out[:half] = x1 cos - x2 sin, out[half:] = x2 cos + x1 sin (the rotate_half
layout). Maths is fp32 with one rounding to the activation dtype, as in the reference.

`tl.cos`/`tl.sin` lower to libdevice's `__nv_cosf`/`__nv_sinf` on NVIDIA and OCML on AMD,
which reduce large arguments exactly, so angles near 131072 rad (128k context) stay accurate;
a fast `cos.approx` would not.

Where it runs: on a GPU tensor (CUDA or ROCm) the Triton kernel always runs. On a CPU tensor the
kernel runs only under the interpreter (`TRITON_INTERPRET=1`, set before this file is imported);
without it, `apply_rope` is `torch_rope`, the same maths in eager PyTorch, so the model still works
anywhere. The model program (kernels/llama_q4k) takes its RoPE from here: the kernels, `torch_rope`
for its plain-PyTorch path, and `rope_inv_freq`.

Self-check: `TRITON_INTERPRET=1 python rope.py` (kernel), or on a GPU `python rope.py`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round fp32 to `dtype` to nearest even, as PyTorch's casts do.

    GPUs round fp32 -> bf16 to nearest even, but Triton's CPU interpreter truncates; rounding
    by hand on the bit pattern gives the same bits on every device.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def rotate_heads(
    x_ptr,
    out_ptr,
    x_head_stride,
    out_head_stride,
    n_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    """Rotate every head of one token: [BLOCK_HEADS, HALF] tiles of both halves at once."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    freqs = tl.arange(0, HALF)[None, :]
    valid = heads < n_heads
    first_half = x_ptr + heads * x_head_stride + freqs
    x1 = tl.load(first_half, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(first_half + HALF, mask=valid, other=0.0).to(tl.float32)
    out_dtype = out_ptr.dtype.element_ty
    out_first_half = out_ptr + heads * out_head_stride + freqs
    tl.store(out_first_half, round_to(x1 * cos - x2 * sin, out_dtype), mask=valid)
    tl.store(out_first_half + HALF, round_to(x2 * cos + x1 * sin, out_dtype), mask=valid)


@triton.jit
def rotate_token_q(
    positions_ptr,
    inv_freq_ptr,
    token,
    q_ptr,
    q_out_ptr,
    q_token_stride,
    q_head_stride,
    q_heads,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
):
    """One token's angles and its query heads rotated into the contiguous q_out
    [tokens, heads, 2 * HALF]; returns the token's position and the cos and sin rows, for the
    caller to rotate its key heads wherever they go."""
    position = tl.load(positions_ptr + token)
    angles = position.to(tl.float32) * tl.load(inv_freq_ptr + tl.arange(0, HALF))
    cos = tl.cos(angles)[None, :]
    sin = tl.sin(angles)[None, :]
    rotate_heads(
        q_ptr + token * q_token_stride,
        q_out_ptr + token * q_heads * 2 * HALF,
        q_head_stride,
        2 * HALF,
        q_heads,
        cos,
        sin,
        HALF,
        BLOCK_Q_HEADS,
    )
    return position, cos, sin


@triton.jit
def rope_kernel(
    positions_ptr,
    inv_freq_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    q_heads,
    kv_heads,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    _, cos, sin = rotate_token_q(
        positions_ptr,
        inv_freq_ptr,
        token,
        q_ptr,
        q_out_ptr,
        q_token_stride,
        q_head_stride,
        q_heads,
        HALF,
        BLOCK_Q_HEADS,
    )
    # k_out is contiguous [tokens, heads, 2 * HALF], as q_out is.
    rotate_heads(
        k_ptr + token * k_token_stride,
        k_out_ptr + token * kv_heads * 2 * HALF,
        k_head_stride,
        2 * HALF,
        kv_heads,
        cos,
        sin,
        HALF,
        BLOCK_KV_HEADS,
    )


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """1 / theta^(2i / head_dim) for i < head_dim / 2, computed as the rope task's reference does,
    so both sides rotate by the same fp32 angles."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def torch_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` in eager PyTorch: pairs (i, i + D/2) rotated by position * inv_freq in fp32,
    rounded once; q, k [..., T, heads, D], positions [T]."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = angles.cos(), angles.sin()
    q32, k32 = q.float(), k.float()
    q_out = (q32 * cos + _rotate_half(q32) * sin).to(q.dtype)
    return q_out, (k32 * cos + _rotate_half(k32) * sin).to(k.dtype)


def apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by position * inv_freq; q [T, Hq, D], k [T, Hkv, D], positions [T]."""
    if not _runs_triton(q):
        return torch_rope(positions, q, k, inv_freq)

    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    # Heads may be strided views of a fused qkv buffer; only the last dimension must be dense.
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    rope_kernel[(tokens,)](
        positions.contiguous(),
        inv_freq.float().contiguous(),
        q,
        k,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_heads,
        kv_heads,
        HALF=head_dim // 2,
        BLOCK_Q_HEADS=triton.next_power_of_2(q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(kv_heads),
        num_warps=4,
    )
    return q_out, k_out


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    inv_freq = rope_inv_freq(128, 500000.0).to(device)
    for positions, dtype in [
        (torch.tensor([0]), torch.bfloat16),
        (torch.tensor([5, 131071, 77]), torch.float16),
        (torch.arange(100, 104), torch.float32),
    ]:
        positions = positions.to(device)
        q = torch.randn(len(positions), 4, 128, dtype=dtype, device=device)
        k = torch.randn(len(positions), 2, 128, dtype=dtype, device=device)
        angles = positions[:, None].double() * inv_freq.double()
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for x, out in zip((q, k), apply_rope(positions, q, k, inv_freq), strict=True):
            x1, x2 = x.double().chunk(2, dim=-1)
            expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    print(f"rope ({path} path on {device}): ok")
