"""RoPE fused with the KV-cache write: q rotated out, k rotated and v copied into the cache.

Unfused, a layer's attention input takes three kernels: the rope kernel (q and k), then one
index_copy_ each for k and v into the cache. At decode each moves a few KB and is all launch,
so the model program does the three in one: per token, one program takes the angles once,
writes the rotated q, and writes the rotated k and the plain v straight into their cache slot
(the slot is the token's position, where an index_copy_ along the sequence would put it).

The angles and rotations are the rope kernel's own (`rotate_token_q`, `rotate_heads`), so
the numbers are the same bits.

Self-check: `TRITON_INTERPRET=1 python -m kernels.llama_q4k.rope_cache`, or on a GPU without
the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.rope.rope import apply_rope, rope_inv_freq, rotate_heads, rotate_token_q


@triton.jit
def copy_heads(
    x_ptr, out_ptr, x_head_stride, out_head_stride, n_heads, D: tl.constexpr, BLOCK_HEADS: tl.constexpr
):
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, D)[None, :]
    valid = heads < n_heads
    x = tl.load(x_ptr + heads * x_head_stride + dims, mask=valid, other=0.0)
    tl.store(out_ptr + heads * out_head_stride + dims, x, mask=valid)


@triton.jit
def rope_cache_kernel(
    positions_ptr,
    inv_freq_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cache_batch_stride,
    cache_head_stride,
    cache_pos_stride,
    seq,
    q_heads,
    kv_heads,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position, cos, sin = rotate_token_q(
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
    slot = (token // seq) * cache_batch_stride + position.to(tl.int64) * cache_pos_stride
    rotate_heads(
        k_ptr + token * k_token_stride,
        k_cache_ptr + slot,
        k_head_stride,
        cache_head_stride,
        kv_heads,
        cos,
        sin,
        HALF,
        BLOCK_KV_HEADS,
    )
    copy_heads(
        v_ptr + token * v_token_stride,
        v_cache_ptr + slot,
        v_head_stride,
        cache_head_stride,
        kv_heads,
        2 * HALF,
        BLOCK_KV_HEADS,
    )


def rope_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rope: Callable | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] rotated (returned), and k rotated and v copied into the caches
    [batch, Hkv, max_seq, D] at their positions; T = batch * seq tokens, batch-major, each at
    its own position (positions [T]). One kernel on GPU tensors and under the
    interpreter; given `rope` (or on plain CPU tensors), the unfused three instead: `rope`
    (default: the rope kernel) on q and k, then index_copy_ of k and v."""
    if rope is not None or not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        q_rot, k_rot = (rope or apply_rope)(positions, q, k, inv_freq)
        batch, kv_heads, _, head_dim = k_cache.shape
        # Token t goes to row t // seq at its own position (rows of a served batch may differ).
        rows = torch.arange(batch, device=positions.device).repeat_interleave(positions.shape[0] // batch)
        k_cache[rows, :, positions] = k_rot.reshape(-1, kv_heads, head_dim).to(k_cache.dtype)
        v_cache[rows, :, positions] = v.reshape(-1, kv_heads, head_dim).to(v_cache.dtype)
        return q_rot
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    batch = k_cache.shape[0]
    if head_dim & (head_dim - 1) or tokens % batch or k_cache.stride(-1) != 1:
        raise ValueError("rope_cache needs a power-of-two head_dim, batch-major tokens and dense caches")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("the k and v caches must share one layout")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    q_out = torch.empty((tokens, q_heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    rope_cache_kernel[(tokens,)](
        positions.contiguous(),
        inv_freq.float().contiguous(),
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tokens // batch,
        q_heads,
        kv_heads,
        HALF=head_dim // 2,
        BLOCK_Q_HEADS=triton.next_power_of_2(q_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(kv_heads),
        num_warps=4,
    )
    return q_out


def example_calls():
    """Launches at Llama-3-8B's shapes (32 query and 8 KV heads of 128; decode at batch 1 and 8,
    prefill of 512), for the compile test."""
    inv_freq = torch.ones(64)
    for batch, seq, dtype in ((1, 1, torch.bfloat16), (8, 1, torch.float16), (1, 512, torch.bfloat16)):
        qkv = torch.zeros(batch * seq, 48, 128, dtype=dtype)
        q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
        cache = torch.zeros(batch, 8, 576, 128, dtype=dtype)
        positions = torch.arange(seq).repeat(batch)
        yield lambda q=q, k=k, v=v, c=cache, p=positions: rope_cache(p, q, k, v, inv_freq, c, c)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for batch, seq, start, dtype in [(1, 1, 700, torch.bfloat16), (2, 5, 3, torch.float16), (3, 2, 0, torch.float32)]:
        q_heads, kv_heads, head_dim, max_seq = 8, 2, 64, 1024
        fused = torch.randn(batch * seq, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
        q, k, v = fused.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (t.reshape(batch * seq, -1, head_dim) for t in (q, k, v))
        positions = torch.arange(start, start + seq, device=device).repeat(batch)
        inv_freq = rope_inv_freq(head_dim, 500000.0).to(device)
        caches = [torch.randn(batch, kv_heads, max_seq, head_dim, dtype=dtype, device=device) for _ in range(2)]
        caches += [cache.clone() for cache in caches]
        want_q = rope_cache(positions, q, k, v, inv_freq, caches[0], caches[1], rope=apply_rope)
        got_q = rope_cache(positions, q, k, v, inv_freq, caches[2], caches[3])
        assert torch.equal(got_q, want_q) and torch.equal(caches[3], caches[1])
        torch.testing.assert_close(caches[2], caches[0], atol=0, rtol=0)
    print(f"rope_cache ({'triton' if device == 'cuda' or os.environ.get('TRITON_INTERPRET') == '1' else 'torch'} on {device}): ok")
