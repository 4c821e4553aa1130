"""Decode attention in two Triton launches: RoPE, the KV-cache write and split-K attention.

At decode a layer's attention is one query token per batch row against the whole cache. The
framework's path is the rope kernel, then scaled_dot_product_attention with a boolean mask,
which on an H200 took six kernels a layer (the mask's conversion, fills, a copy, the fused
attention and a reduction): about 18 us of a 2.7 ms token, for a few MB of cache.

Here:
- `decode_attention_partial_kernel`, one program per (batch row, KV head, split of CHUNK cache
  positions): it rotates the group's query heads and the token's key (the rope kernel's
  angles and rounding), writes the rotated key and the value into the cache slot at the token's
  position (the program whose split holds that position), and takes the attention of its query
  heads over its split. Keys before the position come from the cache; the token's own key and
  value come from registers, so no program reads a slot another is writing.
- `decode_attention_combine_kernel`, one program per (batch row, query head): the splits'
  partial softmax sums rescaled to the common maximum and added (flash-decoding).

The splits are static (max_seq / CHUNK of them, so a CUDA graph can capture the launch); a split
past the position loads nothing (its loads are masked off) and reports an empty partial.

On Hopper both kernels are programmatic dependent launches (see silu_mul's `pdl_launch`): they
wait for the kernel before them only where they read its output. With `settled_cache=True`
(the model's decode step) the partial kernel loads its cache tiles before that wait, while the
qkv GEMV is still running.

Numerics: q and k are rounded to the activation dtype after rotation, as the rope kernel stores
them; scores and the softmax are fp32 (exp2 with log2(e) folded into the scale); probabilities
are rounded to the activation dtype for the product with V, as flash attention does.

Self-check: `TRITON_INTERPRET=1 python -m kernels.llama_q4k.decode_attention`, or on a GPU
without the variable.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.llama_q4k.rope_cache import rope_cache
from kernels.rope.rope import rope_inv_freq
from kernels.silu_mul.silu_mul import gdc_launch_dependents, gdc_wait, pdl_launch, round_to

# Cache positions per program: 128 was faster on the H200 but spills registers at 4 and 8 warps
# for sm_90, which tests/test_kernels_compile.py refuses (figures: this directory's README.md).
CHUNK = 64
LOG2_E = 1.4426950408889634
# Read once, as @triton.jit does: whether the kernels below are interpreted (see `dot`).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, WIDEN: tl.constexpr):
    """a @ b with fp32 accumulation. WIDEN: take fp32 operands at full precision, for fp32
    activations (tl.dot would round them to tf32) and under the interpreter, whose tl.dot
    multiplies bf16 operands' raw bits. bf16 and fp16 products are exact in fp32, so widening
    changes only the order of the sums."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def decode_attention_partial_kernel(
    positions_ptr,
    inv_freq_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    q_batch_stride,
    q_head_stride,
    k_batch_stride,
    k_head_stride,
    v_batch_stride,
    v_head_stride,
    cache_batch_stride,
    cache_head_stride,
    cache_pos_stride,
    kv_heads,
    group,
    n_splits,
    scale_log2,
    position_stride,
    HALF: tl.constexpr,
    BLOCK_G: tl.constexpr,
    CHUNK: tl.constexpr,
    WIDEN: tl.constexpr,
    PDL: tl.constexpr = False,
    CACHE_BEFORE_WAIT: tl.constexpr = False,
):
    if PDL:  # see pdl_launch: the combine after this one may start
        gdc_launch_dependents()
        if not CACHE_BEFORE_WAIT:
            gdc_wait()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    batch_row = (pid // kv_heads).to(tl.int64)
    kv_head = pid % kv_heads
    dtype = k_cache_ptr.dtype.element_ty

    # One position for every row (stride 0), or each row its own (served requests that joined
    # the batch at different times).
    position = tl.load(positions_ptr + batch_row * position_stride)
    freqs = tl.arange(0, HALF)

    # This split's keys and values from the cache: positions before the token's. When the
    # caller says the cache is settled (no kernel in flight writes it: the model's decode step),
    # they load under PDL while the qkv GEMV still runs.
    keys = split * CHUNK + tl.arange(0, CHUNK)
    from_cache = (keys < position)[:, None]
    is_new = (keys == position)[:, None]
    cache = batch_row * cache_batch_stride + kv_head * cache_head_stride
    key_at = cache + keys[:, None].to(tl.int64) * cache_pos_stride
    dims = tl.arange(0, 2 * HALF)
    kc1 = tl.load(k_cache_ptr + key_at + freqs[None, :], mask=from_cache, other=0.0)
    kc2 = tl.load(k_cache_ptr + key_at + HALF + freqs[None, :], mask=from_cache, other=0.0)
    vc = tl.load(v_cache_ptr + key_at + dims[None, :], mask=from_cache, other=0.0)
    # (the angles come after the tiles' loads: libdevice's sin and cos placed before them left
    # 88 B of registers spilled at 4 warps in ptxas for sm_90)
    angles = position.to(tl.float32) * tl.load(inv_freq_ptr + freqs)
    cos, sin = tl.cos(angles), tl.sin(angles)
    if PDL and CACHE_BEFORE_WAIT:
        gdc_wait()  # q, k and v are the GEMV's output

    # The group's query heads, rotated and rounded as the rope kernel stores them.
    g = tl.arange(0, BLOCK_G)[:, None]
    in_group = g < group
    q_at = q_ptr + batch_row * q_batch_stride + (kv_head * group + g) * q_head_stride + freqs[None, :]
    q1 = tl.load(q_at, mask=in_group, other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=in_group, other=0.0).to(tl.float32)
    q1r = round_to(q1 * cos[None, :] - q2 * sin[None, :], dtype)
    q2r = round_to(q2 * cos[None, :] + q1 * sin[None, :], dtype)

    # The token's key, rotated, and its value, in place of the slot's stale contents.
    k_at = k_ptr + batch_row * k_batch_stride + kv_head * k_head_stride + freqs
    k1 = tl.load(k_at).to(tl.float32)
    k2 = tl.load(k_at + HALF).to(tl.float32)
    k1r = round_to(k1 * cos - k2 * sin, dtype)
    k2r = round_to(k2 * cos + k1 * sin, dtype)
    v_new = tl.load(v_ptr + batch_row * v_batch_stride + kv_head * v_head_stride + dims).to(dtype)
    kc1 = tl.where(is_new, k1r[None, :], kc1)
    kc2 = tl.where(is_new, k2r[None, :], kc2)
    vc = tl.where(is_new, v_new[None, :], vc)

    # The program whose split holds the position writes the token into the cache. (The test is
    # made on vectors: the interpreter turns a scalar boolean `&` into an integer mask.)
    into_split = position - split * CHUNK + 0 * dims
    owns = (into_split >= 0) & (into_split < CHUNK)
    slot = cache + position.to(tl.int64) * cache_pos_stride
    tl.store(k_cache_ptr + slot + dims, tl.join(k1r, k2r).permute(1, 0).reshape(2 * HALF), mask=owns)
    tl.store(v_cache_ptr + slot + dims, v_new, mask=owns)

    scores = dot(q1r, tl.trans(kc1), WIDEN) + dot(q2r, tl.trans(kc2), WIDEN)  # [BLOCK_G, CHUNK], fp32
    scores = tl.where((keys <= position)[None, :], scores * scale_log2, float("-inf"))
    m = tl.max(scores, axis=1)
    m_finite = tl.where(m == float("-inf"), 0.0, m)  # an empty split: every p is 0, not NaN
    p = tl.exp2(scores - m_finite[:, None])
    l_sum = tl.sum(p, axis=1)
    acc = dot(p.to(dtype), vc, WIDEN)  # [BLOCK_G, 2 * HALF], fp32

    head = batch_row * kv_heads * group + kv_head * group + tl.arange(0, BLOCK_G)
    part = head * n_splits + split
    in_group_1d = tl.arange(0, BLOCK_G) < group
    tl.store(m_ptr + part, m, mask=in_group_1d)
    tl.store(l_ptr + part, l_sum, mask=in_group_1d)
    tl.store(acc_ptr + part[:, None] * (2 * HALF) + dims[None, :], acc, mask=in_group_1d[:, None])


@triton.jit
def decode_attention_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    n_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # see pdl_launch: the output projection's GEMV may start streaming its weights
        gdc_launch_dependents()
        gdc_wait()
    head = tl.program_id(0).to(tl.int64)  # batch row * heads + head
    splits = tl.arange(0, BLOCK_S)
    real = splits < n_splits
    m = tl.load(m_ptr + head * n_splits + splits, mask=real, other=float("-inf"))
    l_sum = tl.load(l_ptr + head * n_splits + splits, mask=real, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))  # the token's own key is in some split: max is finite
    dims = tl.arange(0, D)
    acc = tl.load(acc_ptr + (head * n_splits + splits)[:, None] * D + dims[None, :], mask=real[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_sum * weight, axis=0)
    tl.store(out_ptr + head * D + dims, round_to(out, out_ptr.dtype.element_ty))


def torch_decode_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rope=None,
) -> torch.Tensor:
    """The framework's path: rope_cache (its torch ops with `rope`), then
    scaled_dot_product_attention over the cache with a position mask. q [B, Hq, D], k and v
    [B, Hkv, D], positions [1] or [B]; returns [B, Hq * D]."""
    batch, q_heads, head_dim = q.shape
    per_row = positions if positions.numel() == batch else positions.repeat(batch)
    q_rot = rope_cache(per_row, q, k, v, inv_freq, k_cache, v_cache, rope=rope)
    # [B, 1, 1, S]: each row attends to its own positions
    mask = (torch.arange(k_cache.shape[2], device=q.device)[None, :] <= per_row[:, None])[:, None, None, :]
    y = F.scaled_dot_product_attention(
        q_rot.view(batch, 1, q_heads, head_dim).transpose(1, 2), k_cache, v_cache, attn_mask=mask, enable_gqa=True
    )
    return y.reshape(batch, q_heads * head_dim)


def decode_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    settled_cache: bool = False,
    chunk: int = CHUNK,
    num_warps: int = 4,
) -> torch.Tensor:
    """One decode token per batch row at position positions[0], or at positions[b] for row b when
    positions has one per row: q [B, Hq, D], k and v [B, Hkv, D]
    (any strides with dense heads), caches [B, Hkv, max_seq, D]. Rotates q and k, writes k and v
    into the caches at the position, and returns the attention output [B, Hq * D] over cache
    positions 0..position. Two kernels on GPU tensors and under the interpreter; plain PyTorch
    on CPU tensors otherwise. `settled_cache`: the caller promises that no kernel still in
    flight writes `positions` or the caches' earlier positions, so under PDL they load before
    the wait for the kernels before this one."""
    if not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return torch_decode_attention(positions, q, k, v, inv_freq, k_cache, v_cache)
    batch, q_heads, head_dim = q.shape
    kv_heads, max_seq = k_cache.shape[1], k_cache.shape[2]
    if (
        head_dim & (head_dim - 1)
        or head_dim < 32
        or q_heads % kv_heads
        or k_cache.stride(-1) != 1
        or k_cache.stride() != v_cache.stride()
        or positions.numel() not in (1, batch)
    ):
        raise ValueError(
            "decode_attention needs one position or one per row, a power-of-two head_dim >= 32, query heads a "
            "multiple of KV heads and dense caches sharing one layout"
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    group = q_heads // kv_heads
    n_splits = triton.cdiv(max_seq, chunk)
    parts = batch * q_heads * n_splits
    m = torch.empty(parts, dtype=torch.float32, device=q.device)
    l_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
    acc = torch.empty(parts * head_dim, dtype=torch.float32, device=q.device)
    decode_attention_partial_kernel[(batch * kv_heads, n_splits)](
        positions,
        inv_freq.float().contiguous(),
        q,
        k,
        v,
        k_cache,
        v_cache,
        m,
        l_sum,
        acc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        kv_heads,
        group,
        n_splits,
        LOG2_E / math.sqrt(head_dim),
        1 if positions.numel() > 1 else 0,
        HALF=head_dim // 2,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot wants 16 rows
        CHUNK=chunk,
        WIDEN=q.dtype == torch.float32 or INTERPRETED,
        CACHE_BEFORE_WAIT=settled_cache,
        num_warps=num_warps,
        **pdl_launch(q),
    )
    out = torch.empty((batch, q_heads * head_dim), dtype=q.dtype, device=q.device)
    decode_attention_combine_kernel[(batch * q_heads,)](
        m,
        l_sum,
        acc,
        out,
        n_splits,
        D=head_dim,
        BLOCK_S=triton.next_power_of_2(n_splits),
        num_warps=4,
        **pdl_launch(q),
    )
    return out


def example_calls():
    """Launches at Llama-3-8B's shapes (32 query and 8 KV heads of 128) at batch 1 and 8, for
    the compile test."""
    inv_freq = torch.ones(64)
    for batch, dtype in ((1, torch.bfloat16), (8, torch.float16)):
        qkv = torch.zeros(batch, 48, 128, dtype=dtype)
        cache = torch.zeros(batch, 8, 576, 128, dtype=dtype)
        position = torch.tensor([300])
        yield lambda qkv=qkv, c=cache, p=position: decode_attention(
            p, qkv[:, :32], qkv[:, 32:40], qkv[:, 40:], inv_freq, c, c.clone()
        )


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    for batch, position, dtype in [(1, 0, torch.bfloat16), (2, 64, torch.float16), (1, 130, torch.float32)]:
        q_heads, kv_heads, head_dim, max_seq = 8, 2, 64, 200
        fused = torch.randn(batch, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
        q, k, v = fused.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k, v = (t.reshape(batch, -1, head_dim) for t in (q, k, v))
        positions = torch.tensor([position], device=device)
        inv_freq = rope_inv_freq(head_dim, 500000.0).to(device)
        caches = [torch.randn(batch, kv_heads, max_seq, head_dim, dtype=dtype, device=device) for _ in range(2)]
        mine = [cache.clone() for cache in caches]
        want = torch_decode_attention(positions, q, k, v, inv_freq, *caches)
        got = decode_attention(positions, q, k, v, inv_freq, *mine)
        assert torch.equal(mine[1], caches[1]), "the value cache differs"
        torch.testing.assert_close(mine[0], caches[0], atol=2e-2, rtol=0)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    print(f"decode_attention ({'triton' if device == 'cuda' or os.environ.get('TRITON_INTERPRET') == '1' else 'torch'} on {device}): ok")
