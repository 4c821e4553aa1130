"""Fused Q4_K GEMV: y = x @ W.T with W dequantized in registers, never in memory.

Decode reads every weight once per token, so the kernel is a race to stream 0.5625 bytes per
weight at HBM speed. Two kernels:

- Batch 1 on NVIDIA Hopper (sm_90): a CUDA kernel on the tensor cores' integer MMAs
  (`CUDA_SOURCE` below, built at first use with torch.utils.cpp_extension.load_inline; needs
  nvcc and ninja): on an H200 about twice the Triton kernel's bandwidth (figures in
  docs/kernels/q4k_gemv.md). Where it cannot be built, the Triton kernel runs instead.
- Batches 2-8 from 1024 weight rows, on NVIDIA Hopper: a second CUDA kernel with the same
  producer and ring whose MMA columns are the rows of x, so one launch reads the weight once
  for the whole batch. Where x of the batch would leave room for one CTA per SM or none
  (K = 14336 from batch 2), it cuts K into parts, each CTA holding x of its part only, and a
  small launch adds the parts (`batched_k_parts`); where even that would not fit, batches of
  4096 rows or more run the batch-1 kernel once per row of x (`cuda_path`).
- Everything else (smaller weights at batch 2-8, AMD GPUs, the CPU interpreter): the Triton
  kernel, which does this:

- The weight bytes are read as int32 words (a Q4_K block is 36 words: d|dmin, 3 words of
  packed 6-bit scales and mins, 32 words of codes), so the 128 code bytes of a block come in as
  16-byte vector loads. Loads are never masked: out-of-range rows and blocks are clamped to a
  valid address and their scale is zeroed, which keeps the loads vectorised.
- Each program owns BLOCK_N rows and takes BLOCK_KB blocks of each row per step, so a small
  grid of programs still has tens of kilobytes in flight per SM.
- The per-weight work is four instructions: a shift, a mask-or that lands the 4-bit code in the
  mantissa of 2^23 (`(q | 0x4B000000)` read as fp32 is 2^23 + q), a subtraction, and one FMA
  with x. No int-to-float conversion, whose throughput on NVIDIA parts is an eighth of FMA's.
- llama.cpp's factorisation: per 32-weight sub-block, y += d*sc * sum(q*x) - dmin*m * sum(x),
  so the scales are applied once per sub-block, not per weight.
- x (bf16 or fp16) is read as int64 quads and widened by bit operations (bf16) or a cast (fp16).
- Decode batches up to 8 rows of x share each weight load.

A second kernel, `q4k_gemv_mma_kernel` (`GemvConfig(method="mma")`), hands the dequantized
fp32 weights to the tensor cores in TF32 instead: per weight only the shift, the mask-or and one
FMA stay on the CUDA cores. It is correct under the interpreter and lowers to Hopper wgmma
without spills; `pick_config` keeps the CUDA-core kernel, the faster one measured so far, until
`kernels/tools/sweep_q4k.py` has timed this one on a GPU.

Where it runs: on a GPU tensor, the CUDA kernel at batch 1 on sm_90 (LOOM_Q4K_CUDA=0 turns it
off; =1 also tries it on newer GPUs, where it has not been checked) and the Triton kernel
otherwise. On a CPU tensor the Triton kernel runs only under the
interpreter (`TRITON_INTERPRET=1`, set before this file is imported);
without it, `forward` dequantizes with torch and multiplies in fp32, so the model works anywhere.

Self-check: `TRITON_INTERPRET=1 python candidate.py` (kernel), or on a GPU `python candidate.py`.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import NamedTuple

import torch
import triton
import triton.language as tl

QK_K = 256  # weights per Q4_K block
BLOCK_BYTES = 144  # d (2) + dmin (2) + scales (12) + codes (128)
BLOCK_WORDS = BLOCK_BYTES // 4
MAX_BATCH_PER_PROGRAM = 8  # decode batches; larger batches take more programs along grid axis 1


class GemvConfig(NamedTuple):
    block_n: int  # output rows per program
    block_kb: int  # Q4_K blocks of each row per loop step
    num_warps: int
    x_per_row: bool = False  # load x per weight row (no layout shuffle) or once per tile
    method: str = "fma"  # "fma": CUDA-core dot products; "mma": TF32 tensor cores (see below)


def pick_config(n_rows: int, n_blocks: int, batch: int) -> GemvConfig:
    """Small tiles, one warp, x loaded per weight row: the fastest tiling at batch 1 on an H200
    (`kernels/tools/sweep_q4k.py`). K of 56 blocks (4096 x 14336) prefers 8 blocks per step, the
    others 16. Below 4096 rows, one row per program: two would leave the H200's 132 SMs with
    under 4 one-warp programs each (figures: docs/kernels/q4k_gemv.md)."""
    block_kb = 16 if n_blocks % 16 == 0 else 8
    block_kb = min(block_kb, triton.next_power_of_2(n_blocks))
    block_n = 2 if n_rows >= 4096 else 1
    return GemvConfig(block_n=block_n, block_kb=block_kb, num_warps=1, x_per_row=True)


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
def widen(pair, high: tl.constexpr, X_IS_BF16: tl.constexpr):
    """One 16-bit half of an int32 pair of x values, as fp32."""
    if X_IS_BF16:
        if high:
            bits = pair & -65536  # 0xFFFF0000: the high bf16 is already in place
        else:
            bits = pair << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        if high:
            half = (pair >> 16) & 0xFFFF
        else:
            half = pair & 0xFFFF
        return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_block_tile(w_ptr, row_words, blocks, n_blocks):
    """For blocks `blocks` of the rows starting at `row_words`: the clamped block indices, the
    word offset of each [row, block], d and dmin (fp32) and the three packed scale words.

    Blocks past the end are clamped to the last one, so every load stays unmasked (and
    vectorised), and get d = dmin = 0, so they contribute exactly nothing."""
    block_ok = blocks < n_blocks
    blocks_safe = tl.minimum(blocks, n_blocks - 1)
    block_words = row_words[:, None] + blocks_safe[None, :] * 36  # [N, KB]; 36 words per block
    head = tl.load(w_ptr + block_words).to(tl.uint32, bitcast=True)
    s1 = tl.load(w_ptr + block_words + 1).to(tl.uint32, bitcast=True)
    s2 = tl.load(w_ptr + block_words + 2).to(tl.uint32, bitcast=True)
    s3 = tl.load(w_ptr + block_words + 3).to(tl.uint32, bitcast=True)
    d = (head & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (head >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    d = tl.where(block_ok[None, :], d, 0.0)
    dmin = tl.where(block_ok[None, :], dmin, 0.0)
    return blocks_safe, block_words, d, dmin, s1, s2, s3


@triton.jit
def scale_and_min(s1, s2, s3, j: tl.constexpr):
    """The 6-bit scale and min of sub-block j from the three packed words s1, s2, s3.

    Bytes s[0..11]: j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: the low four bits are in
    s[j+4] (scale low nibble, min high nibble), the top two in s[j-4] (scale) and s[j] (min).
    """
    if j < 4:
        sc = (s1 >> (8 * j)) & 63
        m = (s2 >> (8 * j)) & 63
    else:
        sc = ((s3 >> (8 * (j - 4))) & 0x0F) | (((s1 >> (8 * (j - 4) + 6)) & 3) << 4)
        m = ((s3 >> (8 * (j - 4) + 4)) & 0x0F) | (((s2 >> (8 * (j - 4) + 6)) & 3) << 4)
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def q4k_gemv_kernel(
    x_ptr,  # x as int64 quads: [batch, K / 4]
    w_ptr,  # W as int32 words: [N, n_blocks * 36]
    out_ptr,
    batch,
    n_rows,
    n_blocks,
    w_row_words,
    x_row_quads,
    out_row_stride,
    X_IS_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_B: tl.constexpr,
    X_PER_ROW: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_safe = tl.minimum(rows, n_rows - 1)  # clamp instead of masking: loads stay vectorised
    row_words = tl.multiple_of(rows_safe.to(tl.int64) * w_row_words, 4)
    first_batch = tl.program_id(1) * BLOCK_B
    kbs = tl.arange(0, BLOCK_KB)
    words8 = tl.arange(0, 8)
    batch_ids = tl.arange(0, BLOCK_B)
    acc = tl.zeros([BLOCK_B, BLOCK_N, BLOCK_KB], dtype=tl.float32)

    for kb0 in range(0, n_blocks, BLOCK_KB):
        blocks_safe, block_words, d, dmin, s1, s2, s3 = load_block_tile(
            w_ptr, row_words, kb0 + kbs, n_blocks
        )

        for c in tl.static_range(4):  # 32-byte chunk c holds sub-blocks 2c (low) and 2c+1 (high)
            code_words = tl.multiple_of(block_words + 4 + 8 * c, [4, 4])
            codes = tl.load(w_ptr + code_words[:, :, None] + words8[None, None, :])
            codes = codes.to(tl.uint32, bitcast=True)  # [N, KB, 8]
            for n in tl.static_range(2):
                j = 2 * c + n
                sc, m = scale_and_min(s1, s2, s3, j)
                # Sub-block j's 32 x values as 8 int64 quads: word w's byte b is lane 4w + b.
                x_quads = blocks_safe[:, None] * 64 + j * 8 + words8[None, :]  # [KB, 8]
                for b_i in tl.static_range(BLOCK_B):
                    b_row = tl.minimum(first_batch + b_i, batch - 1)
                    x_row = x_ptr + b_row.to(tl.int64) * x_row_quads
                    if X_PER_ROW:  # x loaded in the weight tile's own shape: no layout shuffle
                        quad = tl.load(x_row + tl.broadcast_to(x_quads[None, :, :], (BLOCK_N, BLOCK_KB, 8)))
                    else:
                        quad = tl.load(x_row + x_quads)
                    lo = quad.to(tl.int32)  # lanes 4w, 4w+1
                    hi = (quad >> 32).to(tl.int32)  # lanes 4w+2, 4w+3
                    qx = tl.zeros([BLOCK_N, BLOCK_KB, 8], dtype=tl.float32)
                    if X_PER_ROW:
                        x_sum = tl.zeros([BLOCK_N, BLOCK_KB, 8], dtype=tl.float32)
                    else:
                        x_sum = tl.zeros([BLOCK_KB, 8], dtype=tl.float32)
                    for byte in tl.static_range(4):
                        xv = widen(lo if byte < 2 else hi, byte % 2 == 1, X_IS_BF16)
                        # The code lands in mantissa bits 19..22 of 1.0: the float is 1 + q/16,
                        # exact, so sum((1 + q/16) x) - sum(x) = sum(q x) / 16 without any
                        # int-to-float conversion.
                        at = 8 * byte + 4 * n  # the code's bit position in the word
                        if at <= 19:
                            moved = codes << (19 - at)
                        else:
                            moved = codes >> (at - 19)
                        q = ((moved & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
                        if X_PER_ROW:
                            qx += q * xv
                        else:
                            qx += q * xv[None, :, :]
                        x_sum += xv
                    if X_PER_ROW:
                        sum_x = tl.sum(x_sum, axis=2)  # [N, KB], equal rows
                    else:
                        sum_x = tl.sum(x_sum, axis=1)[None, :]  # [1, KB]
                    sum_qx = (tl.sum(qx, axis=2) - sum_x) * 16.0  # [N, KB]
                    contribution = d * sc * sum_qx - dmin * m * sum_x
                    if BLOCK_B == 1:
                        acc += contribution[None, :, :]
                    else:
                        acc = tl.where(batch_ids[:, None, None] == b_i, acc + contribution[None, :, :], acc)

    result = tl.sum(acc, axis=2)  # [B, N]
    out_rows = first_batch + batch_ids
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * out_row_stride + rows[None, :]
    out_ok = (out_rows < batch)[:, None] & (rows < n_rows)[None, :]
    tl.store(out_ptrs, round_to(result, out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def dequantize_byte(codes, slope, intercept, at: tl.constexpr):
    """Weights of the codes at bit `at` of each word: (16 d sc) q' - (16 d sc + dmin m), with
    q' = 1 + q/16 built by moving the code into mantissa bits 19..22 of 1.0 (one shift, its
    direction fixed at compile time) and one mask-or."""
    if at <= 19:
        moved = codes << (19 - at)
    else:
        moved = codes >> (at - 19)
    q = ((moved & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
    return slope[:, :, None] * q + intercept[:, :, None]


@triton.jit
def q4k_gemv_mma_kernel(
    x_ptr,  # [batch, K], bf16 or fp16
    w_ptr,  # W as int32 words: [N, n_blocks * 36]
    out_ptr,
    batch,
    n_rows,
    n_blocks,
    w_row_words,
    x_row_stride,
    out_row_stride,
    BLOCK_N: tl.constexpr,
    BLOCK_KB: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """The tensor-core variant: each sub-block's weights are dequantized to fp32 in registers
    and handed to tl.dot in TF32 against x padded to BLOCK_B columns. Per weight that is a
    shift, a mask-or and one FMA; x never touches the CUDA cores per weight, and the padding
    costs tensor-core time the H200 has to spare (batch 1 at 3 TB/s needs ~170 TFLOP/s of
    TF32 with 16 columns). TF32 rounds weights and x to 10 mantissa bits: about 1e-3 of an
    output row's RMS, inside the task's scale-aware `check`."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_safe = tl.minimum(rows, n_rows - 1)
    row_words = tl.multiple_of(rows_safe.to(tl.int64) * w_row_words, 4)
    cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < batch
    cols_safe = tl.minimum(cols, batch - 1)
    kbs = tl.arange(0, BLOCK_KB)
    words8 = tl.arange(0, 8)
    k_lane = tl.arange(0, BLOCK_KB * 32)  # the dot's K index: (block, lane) of one sub-block
    acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)

    for kb0 in range(0, n_blocks, BLOCK_KB):
        blocks_safe, block_words, d, dmin, s1, s2, s3 = load_block_tile(
            w_ptr, row_words, kb0 + kbs, n_blocks
        )
        x_blocks = tl.minimum(kb0 + k_lane // 32, n_blocks - 1)
        for c in tl.static_range(4):
            code_words = tl.multiple_of(block_words + 4 + 8 * c, [4, 4])
            codes = tl.load(w_ptr + code_words[:, :, None] + words8[None, None, :])
            codes = codes.to(tl.uint32, bitcast=True)  # [N, KB, 8]
            for n in tl.static_range(2):
                j = 2 * c + n
                sc, m = scale_and_min(s1, s2, s3, j)
                # q' = 1 + q/16 (the code in mantissa bits 19..22 of 1.0), so
                # w = d sc q - dmin m = (16 d sc) q' - (16 d sc + dmin m): one FMA per weight.
                slope = 16.0 * d * sc
                intercept = -(slope + dmin * m)
                # Byte b of word w is lane 4w + b. Each byte gets its own tile so every shift is
                # a compile-time constant (left or right, one per weight); join then interleaves
                # the four tiles back into lane order without moving data between threads.
                w0 = dequantize_byte(codes, slope, intercept, 4 * n)
                w1 = dequantize_byte(codes, slope, intercept, 8 + 4 * n)
                w2 = dequantize_byte(codes, slope, intercept, 16 + 4 * n)
                w3 = dequantize_byte(codes, slope, intercept, 24 + 4 * n)
                w = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [N, KB, 8, 2, 2]: lane order
                w = tl.reshape(w, (BLOCK_N, BLOCK_KB * 32))
                x_offsets = x_blocks * 256 + j * 32 + k_lane % 32  # [KB * 32]
                x_ptrs = x_ptr + cols_safe.to(tl.int64)[None, :] * x_row_stride + x_offsets[:, None]
                xt = tl.load(x_ptrs, mask=col_ok[None, :], other=0.0).to(tl.float32)  # [K, B]
                acc = tl.dot(w, xt, acc, input_precision="tf32")

    out_ptrs = out_ptr + cols.to(tl.int64)[None, :] * out_row_stride + rows[:, None]
    out_ok = (rows < n_rows)[:, None] & col_ok[None, :]
    tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty), mask=out_ok)



# --- The CUDA path: batch 1 on NVIDIA tensor cores --------------------------------------------
#
# Measured on the H200, the Triton kernel above is bound by instruction issue and L1 (about 8
# instructions per weight), and Triton would not give the layout that fixes it. This kernel is
# plain CUDA, built at first use with torch.utils.cpp_extension.load_inline (nvcc and ninja;
# cached per source) and launched on PyTorch's current stream, so graph capture records it.
# Per 16 rows x 256 weights its loop is 153 warp instructions with 8 integer MMAs, against about
# 1,060 for the Triton kernel (counts and the versions it replaced: docs/kernels/q4k_gemv.md):
#
# - A producer warp streams the weights through a ring of shared-memory chunks (16 rows x 8
#   blocks, one 1152-byte bulk copy per row, counted on an mbarrier); eight consumer warps take
#   a block of each chunk and release the slot as soon as its codes are in registers. How deep
#   the ring is, and how much of it streams before the kernel ahead ends (PDL), depend on what
#   that kernel is: the caller says (`cuda_stages`, `items_before_wait`).
# - Codes stay bytes: one AND per four codes (`w & 0x0F0F0F0F` gives q, `w & 0xF0F0F0F0` gives
#   16 q) makes the A operand of an integer `mma.sync.m16n8k32`: no per-weight arithmetic.
# - x becomes integers once per call: per 32-value sub-block, a power of two scales it to
#   int16 (max |x| in [2^13, 2^14)), stored as two signed bytes, x = 256 hi + lo; bf16
#   activations keep all their bits down to 2^-7 of their sub-block's largest, smaller ones
#   round at 2^-14 of it, and the scale is undone in fp32 with the block's scales.
# - B's columns 2c and 2c + 1 hold the high and the low bytes of x of one sub-block of chunk c
#   (zeros elsewhere): one chain of MMAs on the low nibbles gives every (row, even sub-block)
#   sum of both bytes, one on the high nibbles every odd one, exactly in int32, and each lane
#   holds exactly the sub-blocks whose scales it decodes. Eight MMAs per block.
CUDA_SOURCE = r"""
// Q4_K GEMV, batch 1, on the tensor cores.
#include <cuda_runtime.h>
typedef unsigned int u32;
typedef unsigned short u16;

#define WARPS 8
#define ROWS 16
#define BLOCK_BYTES 144
#define CHUNK_BLOCKS 8                           // Q4_K blocks per row in one chunk (one per warp)
#define SEGMENT_BYTES (CHUNK_BLOCKS * BLOCK_BYTES)  // 1152 B of a row: nine whole 128-B lines
#define ROW_STRIDE (SEGMENT_BYTES + 16)              // in shared memory: 4 banks apart per row
#define SLOT_BYTES (ROWS * ROW_STRIDE)
#ifndef MIN_CTAS
#define MIN_CTAS 2
#endif

struct alignas(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ u32 shared_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {  // arrive, and expect bytes
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {  // until that phase completes
  asm volatile(
      "{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; "
      "@!done bra WAIT_%=; }" ::"r"(bar), "r"(parity) : "memory");
}
// The bulk-copy engine moves `bytes` from global to shared memory and counts them on `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ U4 lds128(u32 addr) {
  U4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// d times byte `selector & 3` of `word` (a 6-bit scale or min), in two full-rate instructions
// where a shift, a mask, an I2F and an FMUL were: PRMT builds the float 0x4B0000bb = 2^23 + bb
// (`selector` is 0x7540 | byte: the other result bytes are 0x00, 0x00, 0x4B), and one FMA takes
// d * 2^23 (`minus_d_2_23`, exact, once per row) off d * (2^23 + bb), rounding once: exactly
// the product d * bb. (Only a d of -0 or inf would differ: +0 for -0 * bb, NaN for inf * bb.)
__device__ __forceinline__ float times_byte(float d, float minus_d_2_23, u32 word, u32 selector) {
  return fmaf(d, __uint_as_float(__byte_perm(word, 0x4B000000u, selector)), minus_d_2_23);
}

__device__ __forceinline__ u32 opaque(u32 v) {  // a value the compiler must keep, not rebuild
  asm volatile("" : "+r"(v));
  return v;
}
__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
// D = A (16x32, u8 codes) * B (32x8, bytes of x) + C, int32 accumulate: exact. One wrapper
// per type of x's bytes: s8 (the batch-1 kernel's, and the batched kernel's high bytes) and u8
// (the batched kernel's low bytes).
#define MMA_BYTES(name, x_type)                                                                    \
  __device__ __forceinline__ void name(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) { \
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8." x_type ".s32 {%0,%1,%2,%3}, "       \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                          \
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])                                 \
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                         \
  }
MMA_BYTES(mma_signed, "s8")
MMA_BYTES(mma_unsigned, "u8")

__device__ __forceinline__ float to_float(u32 word, int high, int x_is_bf16) {
  if (x_is_bf16) return __uint_as_float(high ? (word & 0xFFFF0000u) : (word << 16));
  return half_to_float((u16)(high ? (word >> 16) : (word & 0xFFFFu)));
}
__device__ __forceinline__ u16 from_float(float v, int x_is_bf16) {
  if (x_is_bf16) {
    u32 bits = __float_as_uint(v);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((bits >> 16) | 0x40u);  // NaN stays NaN
    return (u16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}

// Eight values of x (raw: 16 bytes, bf16 or fp16), one lane's quarter of a 32-value sub-block
// whose other quarters are in the lanes l ^ 1, l ^ 2, l ^ 3, as int16 split into a signed high
// byte and a low byte: per sub-block a power-of-two scale puts max |x| in [2^13, 2^14), and
// x = unscale * (256 hi + lo), lo signed (SignedLow, in [-128, 128), hi then in [-64, 64]) or
// unsigned. Also the sub-block's float sum of x (for the min term).
struct XBytes {
  u32 hi[2], lo[2];
  float unscale, sum;
};
template <bool SignedLow>
__device__ __forceinline__ XBytes x_as_bytes(U4 raw, int x_is_bf16) {
  const u32 words[4] = {raw.x, raw.y, raw.z, raw.w};
  float v[8], biggest = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = to_float(words[i >> 1], i & 1, x_is_bf16);
    biggest = fmaxf(biggest, fabsf(v[i]));
  }
  biggest = fmaxf(biggest, __shfl_xor_sync(0xFFFFFFFFu, biggest, 1));
  biggest = fmaxf(biggest, __shfl_xor_sync(0xFFFFFFFFu, biggest, 2));
  const int e = (__float_as_uint(biggest) >> 23) & 0xFF;
  // 2^(140 - e) as an exponent field, kept normal both ways; a sub-block below 2^-99 rounds
  // coarser, and inf or NaN zeroes the bytes (its sum, below, carries it)
  const int field = min(max(267 - e, 14), 240);
  const float scale = e == 255 ? 0.f : __uint_as_float((u32)field << 23);
  XBytes out;
  out.unscale = __uint_as_float((u32)(254 - field) << 23);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int q[4];
    // round to nearest int: 1.5 * 2^23 puts it in the low bits; signed, 128 more, so that
    // q + 128 = 256 hi + r with r in [0, 256), and lo = r - 128 is r with its top bit flipped.
    // The float's bits are 0x4B400000 + q (+ 128): their low 16 bits, all the permutes below
    // take, are q's own, so the offset is never subtracted (one instruction per value).
    const float magic = SignedLow ? 12583040.f : 12582912.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = __float_as_int(fmaf(v[4 * half + i], scale, magic));
    const u32 p01 = __byte_perm(q[0], q[1], 0x5140), p23 = __byte_perm(q[2], q[3], 0x5140);
    out.lo[half] = __byte_perm(p01, p23, 0x5410) ^ (SignedLow ? 0x80808080u : 0u);
    out.hi[half] = __byte_perm(p01, p23, 0x7632);
  }
  float sum = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
  sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
  out.sum = sum;
  return out;
}

// A line of zeros (what non-feeding lanes give the MMA as x) and the ring's barriers: `full`
// completes when a slot's bytes have landed, `empty` when every consumer warp has released it.
__device__ __forceinline__ void ring_init(unsigned char* zero_line, u32 full, u32 empty, int stages, int tid) {
  if (tid < 16) reinterpret_cast<u32*>(zero_line)[tid] = 0u;
  if (tid < stages) {
    bar_init(full + 8 * tid, 1);
    bar_init(empty + 8 * tid, WARPS);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
}

// A consumer warp is done reading a slot: once all its lanes have, one arrival for the warp.
__device__ __forceinline__ void release_slot(u32 empty, int slot, int lane) {
  __syncwarp();
  if (lane == 0) bar_arrive(empty + 8 * slot);
}
// The next ring slot, and the round (barrier phase) it is in.
__device__ __forceinline__ void next_slot(int& slot, int& round, int stages) {
  if (++slot == stages) slot = 0, ++round;
}

// The producer warp: streams the CTA's (tile, chunk) items through the ring of `stages` slots,
// one bulk copy per row (lanes 0-15), each slot refilled once its consumers have released it.
// Launched as a programmatic dependent, it streams the first `before_wait` items while the
// kernel ahead still runs and the rest once that kernel has ended (see items_before_wait).
// The CTA's tiles are first_tile, first_tile + tile_step, ...; `W` points at the first of the
// `n_blocks` blocks of each row it reads, rows `row_bytes` apart.
__device__ __forceinline__ void produce(const unsigned char* __restrict__ W, long long row_bytes, int n_rows,
                                        int n_blocks, int items, int n_chunks, int stages, int before_wait,
                                        u32 ring, u32 full, u32 empty, int lane, int first_tile, int tile_step) {
  for (int i = 0, slot = 0, round = 0; i < items; ++i) {
    if (i == before_wait) asm volatile("griddepcontrol.wait;" ::: "memory");
    const int chunk = i % n_chunks;
    const int tile = first_tile + (i / n_chunks) * tile_step;
    if (round > 0) bar_wait(empty + 8 * slot, (round - 1) & 1);
    const u32 bytes = min(CHUNK_BLOCKS, n_blocks - chunk * CHUNK_BLOCKS) * BLOCK_BYTES;
    if (lane == 0) bar_expect(full + 8 * slot, ROWS * bytes);
    __syncwarp();
    if (lane < ROWS) {
      const int row = min(tile * ROWS + lane, n_rows - 1);
      bulk_copy(ring + slot * SLOT_BYTES + lane * ROW_STRIDE, W + row * row_bytes + chunk * SEGMENT_BYTES,
                bytes, full + 8 * slot);
    }
    next_slot(slot, round, stages);
  }
}

// Persistent CTAs of 8 consumer warps and one producer warp. CTA c takes the 16-row tiles
// c, c + gridDim.x, ...; a tile streams through a ring of `stages` chunks of 16 rows x 8 blocks.
// The producer moves each chunk as 16 bulk copies of one row's 1152 contiguous bytes
// (cp.async.bulk, counted on the slot's `full` barrier); consumer warp w computes block w of
// every chunk (blocks w, w + 8, ... of the rows, whose x it prepares once) and releases the
// slot on its `empty` barrier, so no warp waits for the others except once per tile.
// Per block, eight m16n8k32 MMAs (two code words per row and lane; the low nibbles against the
// even sub-blocks' x, the high nibbles against the odd ones'): columns 2c and 2c + 1 of B hold
// the high and low bytes of x of one sub-block of chunk c only, so lane (g, t) ends up holding
// both bytes' sums for rows g, g+8 and sub-blocks 2t, 2t+1: the scales it needs are its own
// chunk's. FullChunks: K is a whole number of chunks (every Llama shape), so every warp has a
// block in every chunk and the loop has no branch for the last chunk's missing blocks (14 of
// its 171 instructions in nvcc 13.0's SASS were that branch and its reconvergence).
template <bool FullChunks>
__global__ void __launch_bounds__((WARPS + 1) * 32, MIN_CTAS)
q4k_gemv_b1_kernel(const unsigned char* __restrict__ W, const u16* __restrict__ x, u16* __restrict__ y,
            int n_rows, int n_blocks, int x_is_bf16, int stages, int before_wait) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_chunks = (n_blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
  const int n_tiles = (n_rows + ROWS - 1) / ROWS;
  const int my_tiles = (n_tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  const int items = my_tiles * n_chunks;  // (tile, chunk) pairs through the CTA's ring

  unsigned char* xs = smem + stages * SLOT_BYTES;          // [n_blocks][8 sub-blocks][64 B]
  float2* meta = reinterpret_cast<float2*>(xs + n_blocks * 512);  // [n_blocks][8]: unscale, sum
  float* partial = reinterpret_cast<float*>(meta + n_blocks * 8);  // [2][WARPS][16]
  unsigned char* zero_line = reinterpret_cast<unsigned char*>(partial + 2 * WARPS * ROWS);  // 64 B
  const u32 ring = shared_addr(smem);
  const u32 full = shared_addr(zero_line + 64), empty = full + 8 * stages;  // [stages] each

  // Let the next kernel start (if launched as a programmatic dependent, it waits for this
  // one's results itself): under PDL its set-up overlaps this kernel.
  asm volatile("griddepcontrol.launch_dependents;");
  ring_init(zero_line, full, empty, stages, tid);

  if (warp == WARPS) {  // the producer
    produce(W, (long long)n_blocks * BLOCK_BYTES, n_rows, n_blocks, items, n_chunks, stages, before_wait, ring,
            full, empty, lane, (int)blockIdx.x, (int)gridDim.x);
    return;
  }

  // Launched as a programmatic dependent of the kernel before it (the model's norm, attention
  // or SwiGLU), the grid starts while that kernel still runs: the producer streams weights,
  // which nothing writes, and the consumers wait here until x (and y's memory) is theirs. A
  // plain launch returns from the wait at once.
  asm volatile("griddepcontrol.wait;" ::: "memory");

  // x of this warp's blocks, while the weights are in flight, as integers: per sub-block a
  // power-of-two scale puts max |x| in [2^13, 2^14), each value is rounded to an int16 there
  // (bf16 keeps all its bits down to 2^-7 of the sub-block's largest value; the rest round at
  // 2^-14 of it), and the int16 is stored as two signed bytes, so the MMAs run on bytes:
  // x = unscale * (256 hi + lo). Sub-block layout (64 B): the 32 high
  // bytes in order, then the 32 low bytes. The per-sub-block float sum of x serves the min
  // term. Lane l takes values 8 (l % 4) .. + 7 of sub-block l / 4; eight blocks' loads are in
  // flight at once (every block of a warp up to K = 16384): faster than rounds of four under PDL
  // on the H200 (docs/kernels/q4k_gemv.md).
  const int my_blocks = n_blocks > warp ? (n_blocks - warp + WARPS - 1) / WARPS : 0;
  {
    const int s = lane >> 2, part = lane & 3;
    for (int first = 0; first < my_blocks; first += 8) {
      U4 raw[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const int b = warp + WARPS * min(first + k, my_blocks - 1);
        raw[k] = *reinterpret_cast<const U4*>(x + b * 256 + s * 32 + part * 8);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (first + k >= my_blocks) break;
        const int b = warp + WARPS * (first + k);
        const XBytes xb = x_as_bytes<true>(raw[k], x_is_bf16);
        unsigned char* sub = xs + (b * 8 + s) * 64 + part * 8;
        *reinterpret_cast<uint2*>(sub) = make_uint2(xb.hi[0], xb.hi[1]);
        *reinterpret_cast<uint2*>(sub + 32) = make_uint2(xb.lo[0], xb.lo[1]);
        if (part == 0) meta[b * 8 + s] = make_float2((s & 1) ? xb.unscale * 0.0625f : xb.unscale, xb.sum);
      }
    }
  }
  __syncwarp();

  // Lane (g, t) with g>>1 == t feeds column g of B: the high bytes (g even) or the low bytes
  // (g odd) of x of sub-block 2t to the low-nibble chain and of sub-block 2t + 1 to the
  // high-nibble chain, each 32 bytes 64 apart; every other lane feeds zeros. The lane's
  // constants stay in registers (opaque): left to itself the compiler rebuilt them in every
  // pass of the loop, ten instructions per block.
  const bool feeds = (g >> 1) == t;
  const u32 x_base = opaque(feeds ? shared_addr(xs) + (g >> 1) * 128 + (g & 1) * 32 : shared_addr(zero_line));
  const u32 x_step = opaque(feeds ? 512u : 0u), x_odd = opaque(feeds ? 64u : 0u);
  const int bsel = (2 * t) & 3;  // byte of the packed 6-bit scale word for sub-block 2t
  const u32 pick_even = opaque(0x7540u | bsel), pick_odd = opaque(0x7540u | (bsel + 1));  // see times_byte
  const u32 codes_g = opaque(g * ROW_STRIDE + 16 + 32 * t), meta_t = opaque(2 * t);

  int slot = 0, round = 0;  // of the ring, as the producer counts them
  for (int tile_iter = 0; tile_iter < my_tiles; ++tile_iter) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
      const int b = chunk * CHUNK_BLOCKS + warp;
      bar_wait(full + 8 * slot, round & 1);
      if (FullChunks || b < n_blocks) {
        const u32 block = ring + slot * SLOT_BYTES + warp * BLOCK_BYTES;
        const u32 row_g = block + g * ROW_STRIDE, row_g8 = block + (g + 8) * ROW_STRIDE;
        const U4 head_g = lds128(row_g), head_g8 = lds128(row_g8);
        U4 q[4];  // this lane's 32 code bytes (chunk t) of rows g and g + 8
        q[0] = lds128(block + codes_g);
        q[1] = lds128(block + codes_g + 16);
        q[2] = lds128(block + codes_g + 8 * ROW_STRIDE);
        q[3] = lds128(block + codes_g + 8 * ROW_STRIDE + 16);
        release_slot(empty, slot, lane);  // the codes are in registers now
        U4 xv[4];  // B fragments: this lane's bytes of x, sub-block 2t then 2t + 1 (or zeros)
        const u32 x_at = x_base + b * x_step;
#pragma unroll
        for (int k = 0; k < 4; ++k) xv[k] = lds128(x_at + (k >> 1) * x_odd + 16 * (k & 1));
        const float2 m0 = meta[b * 8 + meta_t];
        const float2 m1 = meta[b * 8 + meta_t + 1];

        // Per MMA, two code words of each row: the low nibbles (q, masked in place) against
        // the even sub-blocks' x, the high nibbles (16 q) against the odd ones'. Column 2t of
        // each chain sums against the high bytes, column 2t + 1 against the low bytes.
        int even[4] = {}, odd[4] = {};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          // words 2m and 2m + 1 of this lane's codes in rows g and g + 8, and of x's bytes
          const u32 g_0 = (&q[m >> 1].x)[2 * (m & 1)], g_1 = (&q[m >> 1].x)[2 * (m & 1) + 1];
          const u32 g8_0 = (&q[2 + (m >> 1)].x)[2 * (m & 1)], g8_1 = (&q[2 + (m >> 1)].x)[2 * (m & 1) + 1];
          const u32 xe0 = (&xv[m >> 1].x)[2 * (m & 1)], xe1 = (&xv[m >> 1].x)[2 * (m & 1) + 1];
          const u32 xo0 = (&xv[2 + (m >> 1)].x)[2 * (m & 1)], xo1 = (&xv[2 + (m >> 1)].x)[2 * (m & 1) + 1];
          // A's registers: row g, row g + 8 (k 4t..4t+3), then the same rows for k 16+4t..
          const u32 l0 = g_0 & 0x0F0F0F0Fu, l1 = g8_0 & 0x0F0F0F0Fu, l2 = g_1 & 0x0F0F0F0Fu, l3 = g8_1 & 0x0F0F0F0Fu;
          const u32 h0 = g_0 & 0xF0F0F0F0u, h1 = g8_0 & 0xF0F0F0F0u, h2 = g_1 & 0xF0F0F0F0u, h3 = g8_1 & 0xF0F0F0F0u;
          mma_signed(even, l0, l1, l2, l3, xe0, xe1);
          mma_signed(odd, h0, h1, h2, h3, xo0, xo1);
        }
        const float c[4] = {(float)(even[0] * 256 + even[1]), (float)(odd[0] * 256 + odd[1]),
                            (float)(even[2] * 256 + even[3]), (float)(odd[2] * 256 + odd[3])};

        // d * sc and dmin * m for rows g, g+8 and sub-blocks 2t, 2t+1
        float dsc[4], dmm[4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const U4 h = r ? head_g8 : head_g;
          const float d = half_to_float((u16)(h.x & 0xFFFFu)), dmin = half_to_float((u16)(h.x >> 16));
          u32 scw, mw;
          if (t < 2) {
            scw = h.y & 0x3F3F3F3Fu;
            mw = h.z & 0x3F3F3F3Fu;
          } else {
            scw = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
            mw = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
          }
          const float minus_d_2_23 = d * -8388608.f, minus_dmin_2_23 = dmin * -8388608.f;
          dsc[2 * r] = times_byte(d, minus_d_2_23, scw, pick_even);
          dsc[2 * r + 1] = times_byte(d, minus_d_2_23, scw, pick_odd);
          dmm[2 * r] = times_byte(dmin, minus_dmin_2_23, mw, pick_even);
          dmm[2 * r + 1] = times_byte(dmin, minus_dmin_2_23, mw, pick_odd);
        }
        acc[0] += dsc[0] * m0.x * c[0] - dmm[0] * m0.y;
        acc[1] += dsc[1] * m1.x * c[1] - dmm[1] * m1.y;
        acc[2] += dsc[2] * m0.x * c[2] - dmm[2] * m0.y;
        acc[3] += dsc[3] * m1.x * c[3] - dmm[3] * m1.y;
      } else {
        release_slot(empty, slot, lane);
      }
      next_slot(slot, round, stages);
    }

    // This tile's rows: lanes t = 0..3 hold a row's sub-blocks 2t, 2t+1; warps hold blocks.
    float top = acc[0] + acc[1], bottom = acc[2] + acc[3];
    top += __shfl_xor_sync(0xFFFFFFFFu, top, 1);
    top += __shfl_xor_sync(0xFFFFFFFFu, top, 2);
    bottom += __shfl_xor_sync(0xFFFFFFFFu, bottom, 1);
    bottom += __shfl_xor_sync(0xFFFFFFFFu, bottom, 2);
    float* sums = partial + (tile_iter & 1) * (WARPS * ROWS);
    if (t == 0) {
      sums[warp * ROWS + g] = top;
      sums[warp * ROWS + g + 8] = bottom;
    }
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");  // the consumers only
    const int row = ((int)blockIdx.x + tile_iter * (int)gridDim.x) * ROWS + tid;
    if (tid < ROWS && row < n_rows) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) total += sums[w * ROWS + tid];
      y[row] = from_float(total, x_is_bf16);
    }
  }
}

// Host side, called from the C++ binding below with PyTorch's current stream.
// The kernel may use up to `max_bytes` of dynamic shared memory (set once: lowering it later
// would make launches that need more fail).
bool q4k_gemv_b1_allow(int max_bytes) {
  const bool ok = cudaFuncSetAttribute(q4k_gemv_b1_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       max_bytes) == cudaSuccess &&
                  cudaFuncSetAttribute(q4k_gemv_b1_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       max_bytes) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok;
}

int q4k_gemv_b1_resident(int shared_bytes) {  // CTAs per SM at this shared memory; 0: too big
  int per_sm = 0;
  int partial = 0;  // the smaller of the two builds' occupancies
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, q4k_gemv_b1_kernel<true>, (WARPS + 1) * 32, shared_bytes);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&partial, q4k_gemv_b1_kernel<false>, (WARPS + 1) * 32, shared_bytes);
  return per_sm < partial ? per_sm : partial;
}

// `dependent`: launch with programmatic stream serialization, so the grid may start before
// the previous kernel in the stream ends (it waits for it before touching x and y).
static cudaLaunchConfig_t launch_config(int grid, int shared_bytes, int dependent, cudaStream_t stream,
                                        cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3((WARPS + 1) * 32);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute->val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = dependent ? 1 : 0;
  return config;
}

bool q4k_gemv_b1_launch(const void* W, const void* x, void* y, int n_rows, int n_blocks,
                        int x_is_bf16, int stages, int before_wait, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(grid, shared_bytes, dependent, stream, &attribute);
  return cudaLaunchKernelEx(&config,
                            n_blocks % CHUNK_BLOCKS == 0 ? q4k_gemv_b1_kernel<true> : q4k_gemv_b1_kernel<false>,
                            static_cast<const unsigned char*>(W),
                            static_cast<const u16*>(x), static_cast<u16*>(y), n_rows, n_blocks,
                            x_is_bf16, stages, before_wait) == cudaSuccess;
}

// ---- Batches 2-8: one launch reads the weight once for every row of x. ----
// The same persistent CTAs, producer warp and ring as above. What changes is the MMA's use:
// its k runs inside one sub-block and its 8 columns are the rows of x. A dot product's terms may
// be taken in any order, so lane t holds codes 8t .. 8t+7 of a sub-block in A (one 8-byte load
// per row) and the same eight values of x in B. Lane (g, t) then ends up with rows g and g + 8
// of y for x rows 2t and 2t + 1, per sub-block, and every column is useful: 16 MMAs per block
// serve up to 8 rows of x, as they serve one at batch 1.
// x in shared memory, per block b, sub-block s, row n of x: 64 B, for t = 0..3 the 8 high
// bytes then the 8 low bytes of values 8t .. 8t+7 (one 16-byte load per lane and sub-block);
// meta per (b, s, n): (unscale, sum of x), with the high-nibble sub-blocks' 1/16 folded in.
// Where x of every row does not leave room for two CTAs per SM (K = 14336 from batch 2), K is
// cut into `k_parts` runs of whole chunks: CTA c works on part c % k_parts only (x of that part
// only, and its tiles c / k_parts, + gridDim.x / k_parts, ...), and writes float sums per part
// into `parts` [k_parts][batch][n_rows], which q4k_sum_parts_kernel adds in part order into y.
#define MAX_BATCH 8
__device__ __forceinline__ uint2 lds64(u32 addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__global__ void __launch_bounds__((WARPS + 1) * 32, 2)
q4k_gemv_bn_kernel(const unsigned char* __restrict__ W, const u16* __restrict__ x, u16* __restrict__ y,
                   float* __restrict__ parts, int n_rows, int k_blocks, int batch, int x_is_bf16, int stages,
                   int k_parts) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  // This CTA's part of K: chunks first_chunk .. + n_chunks - 1, blocks block0 .. + n_blocks - 1
  const int my_part = (int)blockIdx.x % k_parts, ctas = (int)gridDim.x / k_parts, cta = (int)blockIdx.x / k_parts;
  const int all_chunks = (k_blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
  const int part_chunks = (all_chunks + k_parts - 1) / k_parts;
  const int first_chunk = my_part * part_chunks;
  const int n_chunks = max(min(part_chunks, all_chunks - first_chunk), 0);  // > 0: the host cuts no empty part
  const int block0 = first_chunk * CHUNK_BLOCKS;
  const int n_blocks = max(min(part_chunks * CHUNK_BLOCKS, k_blocks - block0), 0);
  const int n_tiles = (n_rows + ROWS - 1) / ROWS;
  const int my_tiles = n_chunks > 0 ? (n_tiles - cta + ctas - 1) / ctas : 0;
  const int items = my_tiles * n_chunks;
  const int K = k_blocks * 256;

  unsigned char* xs = smem + stages * SLOT_BYTES;                        // [n_blocks][8][batch][64 B]
  float2* meta = reinterpret_cast<float2*>(xs + n_blocks * 8 * batch * 64);  // [n_blocks][8][batch]
  float* partial = reinterpret_cast<float*>(meta + n_blocks * 8 * batch);    // [2][WARPS][ROWS][MAX_BATCH]
  unsigned char* zero_line = reinterpret_cast<unsigned char*>(partial + 2 * WARPS * ROWS * MAX_BATCH);
  const u32 ring = shared_addr(smem);
  const u32 full = shared_addr(zero_line + 64), empty = full + 8 * stages;

  asm volatile("griddepcontrol.launch_dependents;");
  ring_init(zero_line, full, empty, stages, tid);

  if (warp == WARPS) {  // the producer, as at batch 1, its whole ring ahead of the kernel before
    produce(W + (long long)block0 * BLOCK_BYTES, (long long)k_blocks * BLOCK_BYTES, n_rows, n_blocks, items,
            n_chunks, stages, items, ring, full, empty, lane, cta, ctas);
    return;
  }

  asm volatile("griddepcontrol.wait;" ::: "memory");

  // x as integers, as at batch 1 (per sub-block a power of two puts max |x| in [2^13, 2^14)),
  // for every row of x: lane l makes values 8 (l % 4) .. + 7 of sub-block l / 4 of a block.
  {
    const int s = lane >> 2, part = lane & 3;
    for (int n = 0; n < batch; ++n) {
      for (int b = warp; b < n_blocks; b += WARPS) {
        const U4 raw = *reinterpret_cast<const U4*>(x + (long long)n * K + (block0 + b) * 256 + s * 32 + part * 8);
        const XBytes xb = x_as_bytes<false>(raw, x_is_bf16);
        const int at = (b * 8 + s) * batch + n;
        *reinterpret_cast<U4*>(xs + at * 64 + part * 16) = U4{xb.hi[0], xb.hi[1], xb.lo[0], xb.lo[1]};
        if (part == 0) meta[at] = make_float2((s & 1) ? xb.unscale * 0.0625f : xb.unscale, xb.sum);
      }
    }
  }
  __syncwarp();  // a warp computes the blocks whose x it made (b = warp mod 8), as at batch 1

  // Lane (g, t) feeds column g of B (row g of x), zeros past the batch; it reads the (unscale,
  // sum) of x rows 2t and 2t + 1 for its outputs (zeros past the batch, whose outputs are
  // never stored).
  const bool feeds = g < batch;
  const int n0 = min(2 * t, batch - 1), n1 = min(2 * t + 1, batch - 1);
  const u32 x_lane = shared_addr(xs) + g * 64 + t * 16;
  const u32 zeros = shared_addr(zero_line) + t * 16;

  int slot = 0, round = 0;
  for (int tile_iter = 0; tile_iter < my_tiles; ++tile_iter) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};  // rows g, g | g+8, g+8 x rows of x 2t, 2t+1
    for (int chunk = 0; chunk < n_chunks; ++chunk) {
      const int b = chunk * CHUNK_BLOCKS + warp;
      bar_wait(full + 8 * slot, round & 1);
      if (b < n_blocks) {
        const u32 block = ring + slot * SLOT_BYTES + warp * BLOCK_BYTES;
        const u32 row_g = block + g * ROW_STRIDE, row_g8 = block + (g + 8) * ROW_STRIDE;
        const U4 head_g = lds128(row_g), head_g8 = lds128(row_g8);
        uint2 code_g[4], code_g8[4];  // codes 8t .. 8t+7 of each sub-block pair, rows g and g + 8
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          code_g[j] = lds64(row_g + 16 + 32 * j + 8 * t);
          code_g8[j] = lds64(row_g8 + 16 + 32 * j + 8 * t);
        }
        release_slot(empty, slot, lane);

        // rows g and g + 8: d, dmin, and the packed 6-bit scales and mins of sub-blocks 0-3, 4-7
        float d[2], dmin[2], minus_d_2_23[2], minus_dmin_2_23[2];  // see times_byte
        u32 sc_w[2][2], m_w[2][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const U4 h = r ? head_g8 : head_g;
          d[r] = half_to_float((u16)(h.x & 0xFFFFu));
          dmin[r] = half_to_float((u16)(h.x >> 16));
          minus_d_2_23[r] = d[r] * -8388608.f;
          minus_dmin_2_23[r] = dmin[r] * -8388608.f;
          sc_w[r][0] = h.y & 0x3F3F3F3Fu;
          m_w[r][0] = h.z & 0x3F3F3F3Fu;
          sc_w[r][1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
          m_w[r][1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
        }

#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // sub-block 2j from the low nibbles, 2j + 1 from the high ones (16 q; the 1/16 is in meta)
          const u32 l0 = code_g[j].x & 0x0F0F0F0Fu, l1 = code_g8[j].x & 0x0F0F0F0Fu;
          const u32 l2 = code_g[j].y & 0x0F0F0F0Fu, l3 = code_g8[j].y & 0x0F0F0F0Fu;
          const u32 h0 = code_g[j].x & 0xF0F0F0F0u, h1 = code_g8[j].x & 0xF0F0F0F0u;
          const u32 h2 = code_g[j].y & 0xF0F0F0F0u, h3 = code_g8[j].y & 0xF0F0F0F0u;
#pragma unroll
          for (int odd = 0; odd < 2; ++odd) {
            const int s = 2 * j + odd;
            const int at = (b * 8 + s) * batch;  // (b, s, row 0 of x)
            const U4 xv = lds128(feeds ? x_lane + at * 64 : zeros);  // high x high, low x low
            int hi[4] = {}, lo[4] = {};
            if (odd) {
              mma_signed(hi, h0, h1, h2, h3, xv.x, xv.y);
              mma_unsigned(lo, h0, h1, h2, h3, xv.z, xv.w);
            } else {
              mma_signed(hi, l0, l1, l2, l3, xv.x, xv.y);
              mma_unsigned(lo, l0, l1, l2, l3, xv.z, xv.w);
            }
            const float2 m0 = meta[at + n0], m1 = meta[at + n1];
            const u32 pick = 0x7540u | (s & 3);
            const float dsc0 = times_byte(d[0], minus_d_2_23[0], sc_w[0][s >> 2], pick);
            const float dmm0 = times_byte(dmin[0], minus_dmin_2_23[0], m_w[0][s >> 2], pick);
            const float dsc1 = times_byte(d[1], minus_d_2_23[1], sc_w[1][s >> 2], pick);
            const float dmm1 = times_byte(dmin[1], minus_dmin_2_23[1], m_w[1][s >> 2], pick);
            // two FMAs per output where an FMUL, an FFMA and an FADD were (a different rounding
            // from the batch-1 kernel's, as precise)
            acc[0] = fmaf(-dmm0, m0.y, fmaf(dsc0 * m0.x, (float)(hi[0] * 256 + lo[0]), acc[0]));
            acc[1] = fmaf(-dmm0, m1.y, fmaf(dsc0 * m1.x, (float)(hi[1] * 256 + lo[1]), acc[1]));
            acc[2] = fmaf(-dmm1, m0.y, fmaf(dsc1 * m0.x, (float)(hi[2] * 256 + lo[2]), acc[2]));
            acc[3] = fmaf(-dmm1, m1.y, fmaf(dsc1 * m1.x, (float)(hi[3] * 256 + lo[3]), acc[3]));
          }
        }
      } else {
        release_slot(empty, slot, lane);
      }
      next_slot(slot, round, stages);
    }

    // Across warps (blocks): partial[buffer][warp][row][n], then one thread per (row, n).
    float* sums = partial + (tile_iter & 1) * (WARPS * ROWS * MAX_BATCH);
    sums[(warp * ROWS + g) * MAX_BATCH + 2 * t] = acc[0];
    sums[(warp * ROWS + g) * MAX_BATCH + 2 * t + 1] = acc[1];
    sums[(warp * ROWS + g + 8) * MAX_BATCH + 2 * t] = acc[2];
    sums[(warp * ROWS + g + 8) * MAX_BATCH + 2 * t + 1] = acc[3];
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");
    const int r = tid / MAX_BATCH, n = tid % MAX_BATCH;  // 128 of the 256 consumer threads
    // (the CTA's place, from blockIdx again: registers are short in the loop above)
    const int row = ((int)blockIdx.x / k_parts + tile_iter * ((int)gridDim.x / k_parts)) * ROWS + r;
    if (tid < ROWS * MAX_BATCH && n < batch && row < n_rows) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) total += sums[(w * ROWS + r) * MAX_BATCH + n];
      if (k_parts == 1) {
        y[(long long)n * n_rows + row] = from_float(total, x_is_bf16);
      } else {
        parts[((long long)((int)blockIdx.x % k_parts) * batch + n) * n_rows + row] = total;
      }
    }
  }
}

// y = the parts' sums added in part order (the same bits however the CTAs ran), as a
// programmatic dependent of the batched kernel: it starts while that kernel ends.
__global__ void q4k_sum_parts_kernel(const float* __restrict__ parts, u16* __restrict__ y, int count, int k_parts,
                                     int x_is_bf16) {
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    float total = parts[i];
    for (int p = 1; p < k_parts; ++p) total += parts[(long long)p * count + i];
    y[i] = from_float(total, x_is_bf16);
  }
}

bool q4k_gemv_bn_allow(int max_bytes) {
  const bool ok = cudaFuncSetAttribute(q4k_gemv_bn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       max_bytes) == cudaSuccess;
  if (!ok) cudaGetLastError();
  return ok;
}

int q4k_gemv_bn_resident(int shared_bytes) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, q4k_gemv_bn_kernel, (WARPS + 1) * 32, shared_bytes);
  return per_sm;
}

// `grid`: a multiple of k_parts; `parts`: k_parts * batch * n_rows floats where k_parts > 1.
bool q4k_gemv_bn_launch(const void* W, const void* x, void* y, void* parts, int n_rows, int n_blocks, int batch,
                        int x_is_bf16, int stages, int k_parts, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = launch_config(grid, shared_bytes, dependent, stream, &attribute);
  if (cudaLaunchKernelEx(&config, q4k_gemv_bn_kernel, static_cast<const unsigned char*>(W),
                         static_cast<const u16*>(x), static_cast<u16*>(y), static_cast<float*>(parts), n_rows,
                         n_blocks, batch, x_is_bf16, stages, k_parts) != cudaSuccess)
    return false;
  if (k_parts == 1) return true;
  const int count = batch * n_rows, threads = 256;
  cudaLaunchAttribute sum_attribute;
  cudaLaunchConfig_t sum_config = launch_config(min((count + threads - 1) / threads, 1024), 0, 1, stream,
                                                &sum_attribute);
  sum_config.blockDim = dim3(threads);
  return cudaLaunchKernelEx(&sum_config, q4k_sum_parts_kernel, static_cast<const float*>(parts),
                            static_cast<u16*>(y), count, k_parts, x_is_bf16) == cudaSuccess;
}
"""

CUDA_BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

bool q4k_gemv_b1_allow(int max_bytes);
int q4k_gemv_b1_resident(int shared_bytes);
bool q4k_gemv_b1_launch(const void* W, const void* x, void* y, int n_rows, int n_blocks,
                        int x_is_bf16, int stages, int before_wait, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream);

bool q4k_gemv_bn_allow(int max_bytes);
int q4k_gemv_bn_resident(int shared_bytes);
bool q4k_gemv_bn_launch(const void* W, const void* x, void* y, void* parts, int n_rows, int n_blocks, int batch,
                        int x_is_bf16, int stages, int k_parts, int grid, int shared_bytes, int dependent,
                        cudaStream_t stream);

bool allow(int64_t max_bytes) { return q4k_gemv_b1_allow((int)max_bytes) && q4k_gemv_bn_allow((int)max_bytes); }
int64_t resident_batched(int64_t shared_bytes) { return q4k_gemv_bn_resident((int)shared_bytes); }

void launch_batched(torch::Tensor weight, torch::Tensor x, torch::Tensor out, torch::Tensor parts, int64_t stages,
                    int64_t k_parts, int64_t grid, int64_t shared_bytes, bool dependent) {
  const bool ok = q4k_gemv_bn_launch(weight.data_ptr(), x.data_ptr(), out.data_ptr(), parts.data_ptr(),
                                     (int)weight.size(0), (int)(weight.size(1) / 144), (int)x.size(0),
                                     x.scalar_type() == at::kBFloat16, (int)stages, (int)k_parts, (int)grid,
                                     (int)shared_bytes, dependent,
                                     c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  TORCH_CHECK(ok, "q4k_gemv_bn launch failed: ", cudaGetErrorString(cudaGetLastError()));
}
int64_t resident(int64_t shared_bytes) { return q4k_gemv_b1_resident((int)shared_bytes); }

void launch(torch::Tensor weight, torch::Tensor x, torch::Tensor out, int64_t stages, int64_t before_wait,
            int64_t grid, int64_t shared_bytes, bool dependent) {
  const bool ok = q4k_gemv_b1_launch(weight.data_ptr(), x.data_ptr(), out.data_ptr(), (int)weight.size(0),
                                     (int)(weight.size(1) / 144), x.scalar_type() == at::kBFloat16, (int)stages,
                                     (int)before_wait, (int)grid, (int)shared_bytes, dependent,
                                     c10::cuda::getCurrentCUDAStream(x.get_device()).stream());
  TORCH_CHECK(ok, "q4k_gemv_b1 launch failed: ", cudaGetErrorString(cudaGetLastError()));
}
"""

CUDA_WARPS, CUDA_ROWS, CUDA_MIN_CTAS = 8, 16, 2
CUDA_CHUNK_BLOCKS = 8  # Q4_K blocks per row in a ring slot (CHUNK_BLOCKS: one per consumer warp)
HOPPER_SHARED_PER_SM = 228 * 1024


def cuda_stages(n_blocks: int, follows_small_kernel: bool = False) -> int:
    """Ring slots per CTA: three, and four from K = 8192 when the GEMV follows a small kernel.

    After a small kernel its CTAs fill their rings before that kernel ends, so a fourth slot
    holds more of a row when x arrives; back to back with another GEMV, three were faster. Four
    only while two CTAs still fit an SM (Hopper: 228 KB of shared memory, 1 KB of it reserved
    per CTA). Figures: docs/kernels/q4k_gemv.md."""
    if (
        follows_small_kernel
        and n_blocks >= 32
        and 2 * (cuda_shared_bytes(n_blocks, 4) + 1024) <= HOPPER_SHARED_PER_SM
    ):
        return 4
    return 3


def ring_slots(n_blocks: int, follows_small_kernel: bool = False) -> int:
    """The ring slots a launch uses where the kernel object does not fix them: `cuda_stages`,
    or LOOM_Q4K_STAGES for timing other depths in a whole program, such as the model's decode:
    one depth for every shape ("4"), or depths by Q4_K blocks per row ("16:5,56:4"; shapes not
    named keep `cuda_stages`), each 1-8, whatever the caller says. A kernel object asks once
    per shape and caller context (`CudaGemvB1.stages_for`)."""
    override = os.environ.get("LOOM_Q4K_STAGES", "").strip()
    if not override:
        return cuda_stages(n_blocks, follows_small_kernel)
    by_blocks: dict[int, int] = {}  # key 0: every shape
    for item in override.split(","):
        blocks, _, depth = item.strip().rpartition(":")
        if not depth.isdigit() or not 1 <= int(depth) <= 8 or (blocks and not blocks.isdigit()):
            raise ValueError(
                "LOOM_Q4K_STAGES must be a depth from 1 to 8, or blocks:depth pairs such as "
                f"16:5,56:4, not {override!r}"
            )
        by_blocks[int(blocks or 0)] = int(depth)
    return by_blocks.get(n_blocks, by_blocks.get(0) or cuda_stages(n_blocks, follows_small_kernel))


def items_before_wait(items: int, stages: int, follows_small_kernel: bool = False) -> int:
    """Chunks a batch-1 CTA's producer streams, as a programmatic dependent, before the kernel
    ahead of it has ended; the rest of its `items` (tile, chunk) pairs stream after.

    After a small kernel, the whole ring: nothing else is streaming then. Back to back with
    another heavy kernel, a CTA whose work does not fit its ring starts with one chunk: what it
    streams early competes with the kernel ahead's last CTAs, whose end it waits for (figures:
    docs/kernels/q4k_gemv.md)."""
    if follows_small_kernel or items <= stages:
        return stages
    return 1


CUDA_BATCHED_STAGES = 3  # ring slots of the batched kernel


def _shared_bytes(n_blocks: int, stages: int, x_rows: int, sum_rows: int) -> int:
    """Dynamic shared memory of one CTA of either kernel: the ring of chunks (16 rows x 1152
    bytes, rows padded by 16); x as bytes (64 B) and its scale and sum (8 B) per sub-block and
    row of x; two sets of cross-warp partial sums for `sum_rows` rows of x; a line of zeros; the
    ring's full and empty barriers."""
    return (
        stages * CUDA_ROWS * (CUDA_CHUNK_BLOCKS * BLOCK_BYTES + 16)
        + n_blocks * 8 * x_rows * (64 + 8)
        + 2 * CUDA_WARPS * CUDA_ROWS * sum_rows * 4
        + 64
        + 2 * stages * 8
    )


def part_blocks(n_blocks: int, k_parts: int) -> int:
    """Q4_K blocks per row in the largest of `k_parts` runs of whole chunks that cut K."""
    chunks = -(-n_blocks // CUDA_CHUNK_BLOCKS)
    return min(-(-chunks // k_parts) * CUDA_CHUNK_BLOCKS, n_blocks)


def whole_parts(n_blocks: int, k_parts: int) -> int:
    """The parts K is really cut into when asked for `k_parts`: runs of the same whole number of
    chunks leave none empty (6 chunks in 4 parts are 3 parts of 2; an empty part would leave its
    sums unwritten)."""
    chunks = -(-n_blocks // CUDA_CHUNK_BLOCKS)
    per_part = -(-chunks // max(1, min(k_parts, chunks)))
    return -(-chunks // per_part)


def cuda_batched_shared_bytes(n_blocks: int, batch: int, stages: int, k_parts: int = 1) -> int:
    """The batched kernel's: x of its part of K for every row, partial sums laid out for 8 rows
    of x."""
    return _shared_bytes(part_blocks(n_blocks, k_parts), stages, batch, MAX_BATCH_PER_PROGRAM)


def batched_k_parts(n_blocks: int, batch: int, ctas_per_sm, n_rows: int = 0, sms: int = 0) -> int:
    """How many parts the batched kernel cuts K into.

    Always equal runs of whole chunks (a divisor of the chunks: none is empty or longer than
    the rest). First, room for two CTAs per SM: none (1) where x of every row leaves it; else
    the fewest parts that do (K = 14336, seven chunks: seven parts from batch 2; 1 where none
    does, as more parts only shrink a CTA). Then two equal parts from batch 4 where K is whole
    (less of x to make per CTA), and more equal parts while the tiles of `n_rows` would keep
    fewer than half of the `sms` x CTAs-per-SM resident CTAs busy (figures:
    docs/kernels/q4k_gemv.md).
    `ctas_per_sm(k_parts)`: CTAs per SM with that cut (0: none fits); 1 where nothing fits.
    LOOM_Q4K_K_PARTS sets it for timing (`whole_parts` of it)."""
    chunks = -(-n_blocks // CUDA_CHUNK_BLOCKS)
    forced = os.environ.get("LOOM_Q4K_K_PARTS", "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"LOOM_Q4K_K_PARTS must be a whole number of parts, not {forced!r}")
        return whole_parts(n_blocks, int(forced))
    equal = [parts for parts in range(2, chunks + 1) if chunks % parts == 0 and ctas_per_sm(parts) >= 2]
    parts = 1 if ctas_per_sm(1) >= 2 or not equal else equal[0]
    if parts == 1 and batch >= 4 and 2 in equal:
        parts = 2
    tiles = -(-n_rows // CUDA_ROWS)
    for more in equal:
        if tiles and sms and more > parts and 2 * tiles * parts <= sms * ctas_per_sm(parts):
            parts = more
    return parts


def cuda_shared_bytes(n_blocks: int, stages: int) -> int:
    """The batch-1 kernel's."""
    return _shared_bytes(n_blocks, stages, 1, 1)


def balanced_grid(n_rows: int, resident: int) -> int:
    """CTAs of a persistent grid: at most `resident`, and no more than it takes to give each the
    same number of 16-row tiles (896 tiles on 264 resident CTAs would leave 104 of them a
    fourth tile to do alone at the end; 224 CTAs do four each)."""
    tiles = -(-n_rows // CUDA_ROWS)
    return -(-tiles // -(-tiles // resident))


class CudaGemvB1:
    """The CUDA kernel for one device, built by load_inline (one build per source and
    compile-time setting, cached by PyTorch under TORCH_EXTENSIONS_DIR)."""

    def __init__(
        self,
        device: torch.device,
        stages: int = 0,
        ctas_per_sm: int = 0,
        min_ctas: int = CUDA_MIN_CTAS,
    ) -> None:
        """`stages`: ring slots per CTA (0: `ring_slots` of the shape); `ctas_per_sm`: resident
        CTAs per SM in the persistent grid (0: as many as fit); `min_ctas`: the CTAs per SM the
        compiler must leave registers for."""
        from torch.utils.cpp_extension import load_inline

        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            raise RuntimeError(f"needs sm_90 (bulk copies, mbarriers); this GPU is sm_{major}{minor}")
        if major > 9 and os.environ.get("LOOM_Q4K_CUDA") != "1":
            # The PTX it uses exists there, but it has only been checked on Hopper.
            raise RuntimeError(f"checked on sm_90 only; LOOM_Q4K_CUDA=1 tries it on sm_{major}{minor}")
        flags = [f"MIN_CTAS={min_ctas}"]
        with torch.cuda.device(device):
            self.module = load_inline(
                # the source's hash in the name: two sources never share (and overwrite) a build
                name="loom_q4k_gemv_b1_"
                + hashlib.sha1(CUDA_SOURCE.encode()).hexdigest()[:10]
                + "_"
                + "_".join(flag.replace("=", "") for flag in flags).lower(),
                cpp_sources=CUDA_BINDING,
                cuda_sources=CUDA_SOURCE,
                functions=["allow", "resident", "launch", "resident_batched", "launch_batched"],
                extra_cuda_cflags=[
                    "-O3",
                    f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",
                    *[f"-D{flag}" for flag in flags],
                ],
                verbose=False,
            )
        self.stages, self.ctas_per_sm = stages, ctas_per_sm
        self.max_shared = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
        with torch.cuda.device(device):
            if not self.module.allow(self.max_shared):
                raise RuntimeError(f"could not allow {self.max_shared} bytes of shared memory")
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.per_sm: dict[int, int] = {}  # by shared memory per CTA
        self.batched_per_sm: dict[tuple[int, int, int], int] = {}
        self.stages_by_blocks: dict[tuple[int, bool], int] = {}

    def stages_for(self, n_blocks: int, follows_small_kernel: bool = False) -> int:
        key = (n_blocks, follows_small_kernel)
        if key not in self.stages_by_blocks:  # settled at a shape's first launch
            self.stages_by_blocks[key] = self.stages or ring_slots(n_blocks, follows_small_kernel)
        return self.stages_by_blocks[key]

    def shared_bytes(self, n_blocks: int, follows_small_kernel: bool = False) -> int:
        return cuda_shared_bytes(n_blocks, self.stages_for(n_blocks, follows_small_kernel))

    def fits(self, n_blocks: int, follows_small_kernel: bool = False) -> bool:
        shared = self.shared_bytes(n_blocks, follows_small_kernel)
        return shared <= self.max_shared and self._resident(shared) > 0

    def _resident(self, shared: int) -> int:
        if shared not in self.per_sm:
            self.per_sm[shared] = int(self.module.resident(shared))
        return self.per_sm[shared]

    def grid(self, n_rows: int, n_blocks: int, follows_small_kernel: bool = False) -> int:
        """The persistent grid over every SM full of resident CTAs (`balanced_grid`)."""
        resident = self._resident(self.shared_bytes(n_blocks, follows_small_kernel))
        return balanced_grid(n_rows, self.sms * (self.ctas_per_sm or max(resident, 1)))

    def _batched_per_sm(self, n_blocks: int, batch: int, stages: int, k_parts: int) -> int:
        k_parts = whole_parts(n_blocks, k_parts)
        key = (n_blocks, batch, stages, k_parts)
        if key not in self.batched_per_sm:
            shared = cuda_batched_shared_bytes(n_blocks, batch, stages, k_parts)
            fits = shared <= self.max_shared
            self.batched_per_sm[key] = int(self.module.resident_batched(shared)) if fits else 0
        return self.batched_per_sm[key]

    def batched_k_parts(self, n_blocks: int, batch: int, n_rows: int, stages: int = CUDA_BATCHED_STAGES) -> int:
        """The parts of K the batched kernel takes here (`batched_k_parts`)."""
        return batched_k_parts(
            n_blocks, batch, lambda parts: self._batched_per_sm(n_blocks, batch, stages, parts), n_rows, self.sms
        )

    def batched_ctas_per_sm(
        self, n_blocks: int, batch: int, n_rows: int, stages: int = CUDA_BATCHED_STAGES, k_parts: int = 0
    ) -> int:
        """CTAs of the batched kernel an SM holds at this K, batch, row count and ring depth, K
        cut into `k_parts` (0: as `batched_k_parts` cuts it); 0: none fits."""
        if not 2 <= batch <= MAX_BATCH_PER_PROGRAM:
            return 0
        k_parts = k_parts or self.batched_k_parts(n_blocks, batch, n_rows, stages)
        return self._batched_per_sm(n_blocks, batch, stages, k_parts)

    def batched_fits(
        self, n_blocks: int, batch: int, n_rows: int, stages: int = CUDA_BATCHED_STAGES, k_parts: int = 0
    ) -> bool:
        """Whether the batched kernel's shared memory fits a CTA at this K, batch and ring depth."""
        return self.batched_ctas_per_sm(n_blocks, batch, n_rows, stages, k_parts) > 0

    def batched(
        self,
        x: torch.Tensor,
        weight_q4k: torch.Tensor,
        out: torch.Tensor,
        dependent: bool = False,
        stages: int = CUDA_BATCHED_STAGES,
        k_parts: int = 0,
    ) -> None:
        """Batches 2-8 in one launch that reads the weight once (`batched_fits` first); where K
        is cut into parts (`k_parts`, 0: `batched_k_parts`), a second small launch adds the
        parts' float sums into `out`."""
        n_rows, n_blocks, batch = weight_q4k.shape[0], weight_q4k.shape[1] // BLOCK_BYTES, x.shape[0]
        k_parts = whole_parts(n_blocks, k_parts) if k_parts else self.batched_k_parts(n_blocks, batch, n_rows, stages)
        shared = cuda_batched_shared_bytes(n_blocks, batch, stages, k_parts)
        resident = self.sms * max(self.batched_ctas_per_sm(n_blocks, batch, n_rows, stages, k_parts), 1)
        grid = k_parts * balanced_grid(n_rows, max(resident // k_parts, 1))  # the same CTAs for every part
        parts = torch.empty((k_parts, batch, n_rows) if k_parts > 1 else (0,), dtype=torch.float32, device=x.device)
        self.module.launch_batched(
            weight_q4k, x, out, parts, stages, k_parts, grid, shared,
            dependent and os.environ.get("LOOM_Q4K_PDL") != "0",
        )

    def __call__(
        self,
        x: torch.Tensor,
        weight_q4k: torch.Tensor,
        out: torch.Tensor,
        dependent: bool = False,
        follows_small_kernel: bool = False,
    ) -> None:
        """y = x @ W.T for x [batch, K]: one launch per row of x, each reading the whole weight.

        `dependent`: launch the first row as a programmatic dependent of the kernel before it in
        the stream, whose weight reads then start before that kernel's writes are visible: only
        for a weight no kernel writes (see q4k_gemv's constant_weight). Every later row is a
        dependent whatever the caller says: the kernel before it is this GEMV, which writes no
        weight, and it started only after everything before it in the stream had finished.
        `follows_small_kernel`: the ring depth and prefetch for that context (`cuda_stages`,
        `items_before_wait`), taken only by a single row: a batch's rows after the first follow
        this GEMV itself, and one depth serves all of a call's launches."""
        n_rows, n_blocks = weight_q4k.shape[0], weight_q4k.shape[1] // BLOCK_BYTES
        after = follows_small_kernel and x.shape[0] == 1
        stages = self.stages_for(n_blocks, after)
        grid, shared = self.grid(n_rows, n_blocks, after), self.shared_bytes(n_blocks, after)
        tiles = -(-n_rows // CUDA_ROWS)
        items = -(-tiles // grid) * -(-n_blocks // CUDA_CHUNK_BLOCKS)  # the busiest CTA's (tile, chunk) pairs
        before_wait = items_before_wait(items, stages, after)
        pdl = os.environ.get("LOOM_Q4K_PDL") != "0"
        for row in range(x.shape[0]):
            self.module.launch(
                weight_q4k,
                x[row : row + 1],
                out[row : row + 1],
                stages,
                before_wait,
                grid,
                shared,
                pdl and (dependent or row > 0),
            )


_cuda_kernels: dict[int, CudaGemvB1 | None] = {}


# Batches the CUDA kernels take, from this many weight rows up: the batched kernel (measured
# from 1024 rows), and one batch-1 launch per row of x (measured from 4096 rows).
CUDA_BATCHED_FROM_N_ROWS = 1024
CUDA_ROWS_FROM_N_ROWS = 4096


def cuda_path(n_rows: int, batch: int, batched_ctas_per_sm: int) -> str | None:
    """Which CUDA kernel runs a batch: "batched" (one launch, the weight read once), "rows" (the
    batch-1 kernel once per row of x, the weight read per row), or None (the Triton kernel).
    `batched_ctas_per_sm`: how many CTAs of the batched kernel fit an SM at this K and batch
    (0: it does not fit).

    From 1024 weight rows, the batched kernel where two of its CTAs fit an SM (it cuts K so that
    they do, `batched_k_parts`), or one from batch 3; else per-row launches from 4096 rows, which
    beat the Triton kernel there but not at 1024 rows (figures: docs/kernels/q4k_gemv.md)."""
    if batch == 1:
        return "rows"
    if not 2 <= batch <= MAX_BATCH_PER_PROGRAM:
        return None
    if n_rows >= CUDA_BATCHED_FROM_N_ROWS and (
        batched_ctas_per_sm >= 2 or (batched_ctas_per_sm == 1 and batch >= 3)
    ):
        return "batched"
    return "rows" if n_rows >= CUDA_ROWS_FROM_N_ROWS else None


def cuda_takes_batch(n_rows: int, batch: int) -> bool:
    """Whether a batch may run on a CUDA kernel at all, before the kernel is built to ask how
    the batched kernel fits: `cuda_path` with the best fit."""
    return cuda_path(n_rows, batch, batched_ctas_per_sm=2) is not None


def cuda_gemv_b1(device: torch.device) -> CudaGemvB1 | None:
    """The built kernel for `device`, or None where it cannot be built here (said once on
    stderr: no nvcc or ninja, or not a Hopper GPU); LOOM_Q4K_CUDA=0 turns it off, =1 also
    tries it past Hopper."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_kernels:
        kernel = None
        if os.environ.get("LOOM_Q4K_CUDA", "1") != "0" and torch.version.cuda:
            try:
                kernel = CudaGemvB1(torch.device("cuda", index))
            except (RuntimeError, OSError, ImportError) as exc:
                print(f"q4k_gemv: the CUDA kernel is unavailable, using Triton: {exc}", file=sys.stderr)
        _cuda_kernels[index] = kernel
    return _cuda_kernels[index]


def _cuda_kernel(
    x: torch.Tensor, weight_q4k: torch.Tensor, n_blocks: int, follows_small_kernel: bool = False
) -> CudaGemvB1 | None:
    """The CUDA kernel, where it is built, its shared memory fits, and x and W are 16-byte
    aligned (its vector loads and bulk copies)."""
    if x.data_ptr() % 16 or weight_q4k.data_ptr() % 16:
        return None
    kernel = cuda_gemv_b1(x.device)
    return kernel if kernel is not None and kernel.fits(n_blocks, follows_small_kernel) else None


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _dequantize_q4_k(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K bytes [..., n * 144] into float32 [..., n * 256] (the CPU path without Triton)."""
    blocks = packed.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    s = blocks[:, 4:16]
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    # Chunk c's low nibbles are sub-block 2c, its high nibbles 2c+1. (No tensor literal here:
    # copying one to the GPU inside forward would break CUDA-graph capture.)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    weights = (d * sc.float())[:, :, None] * codes - (dmin * m.float())[:, :, None]
    return weights.reshape(*packed.shape[:-1], -1)


def q4k_gemv(
    x: torch.Tensor,
    weight_q4k: torch.Tensor,
    config: GemvConfig | None = None,
    constant_weight: bool = False,
    follows_small_kernel: bool = False,
) -> torch.Tensor:
    """x [batch, K] @ dequantize(weight_q4k [N, K / 256 * 144]).T -> [batch, N] in x's dtype.

    `constant_weight`: the caller promises no kernel writes the weight (a model's parameters).
    The CUDA kernel is then launched as a programmatic dependent (PDL, Hopper): it streams the
    weight while the kernel before it still runs, and waits for that kernel only before it
    reads x. Without the promise it is a plain launch, since a weight written by the kernel
    just before could be read stale.
    `follows_small_kernel`: what runs just before is a small kernel (a norm, an elementwise
    op, decode attention), not another heavy stream such as this GEMV: at batch 1 the CUDA
    kernel then prefetches deeper from K = 8192 (`cuda_stages` has the measurements). Only
    the ring depth changes, never the result."""
    batch, k = x.shape
    n_rows = weight_q4k.shape[0]
    if (
        k % QK_K
        or weight_q4k.dtype != torch.uint8
        or weight_q4k.shape[1] != k // QK_K * BLOCK_BYTES
    ):
        raise ValueError(f"weight must be uint8 [N, {k // QK_K * BLOCK_BYTES}] Q4_K rows for K={k}")
    # The kernel reads 16-bit activations; float32 ones (the model program's CPU reference
    # runs) take the torch path.
    if not _runs_triton(x) or x.dtype not in (torch.bfloat16, torch.float16):
        return (x.float() @ _dequantize_q4_k(weight_q4k).T).to(x.dtype)

    weight_q4k = weight_q4k.contiguous()
    x = x.contiguous()
    out = torch.empty((batch, n_rows), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    n_blocks = k // QK_K
    kernel = (
        _cuda_kernel(x, weight_q4k, n_blocks, follows_small_kernel and batch == 1)
        if config is None and x.is_cuda and cuda_takes_batch(n_rows, batch)
        else None
    )
    if kernel is not None:
        batched_per_sm = kernel.batched_ctas_per_sm(n_blocks, batch, n_rows) if batch > 1 else 0
        if os.environ.get("LOOM_Q4K_BATCHED") == "0":  # for A/B timing against per-row launches
            batched_per_sm = 0
        path = cuda_path(n_rows, batch, batched_per_sm)
        if path == "batched":
            kernel.batched(x, weight_q4k, out, dependent=constant_weight)
            return out
        if path == "rows":
            kernel(x, weight_q4k, out, dependent=constant_weight, follows_small_kernel=follows_small_kernel)
            return out
    config = config or pick_config(n_rows, n_blocks, batch)
    if config.method == "mma":
        block_b = 16  # the smallest tl.dot width; decode batches fit in one column of programs
        grid = (triton.cdiv(n_rows, config.block_n), triton.cdiv(batch, block_b))
        q4k_gemv_mma_kernel[grid](
            x,
            weight_q4k.view(torch.int32),
            out,
            batch,
            n_rows,
            n_blocks,
            n_blocks * BLOCK_WORDS,
            x.stride(0),
            out.stride(0),
            BLOCK_N=config.block_n,
            BLOCK_KB=config.block_kb,
            BLOCK_B=block_b,
            num_warps=config.num_warps,
        )
        return out
    block_b = min(triton.next_power_of_2(batch), MAX_BATCH_PER_PROGRAM)
    grid = (triton.cdiv(n_rows, config.block_n), triton.cdiv(batch, block_b))
    q4k_gemv_kernel[grid](
        x.view(torch.int64),
        weight_q4k.view(torch.int32),
        out,
        batch,
        n_rows,
        n_blocks,
        n_blocks * BLOCK_WORDS,
        k // 4,
        out.stride(0),
        X_IS_BF16=x.dtype == torch.bfloat16,
        BLOCK_N=config.block_n,
        BLOCK_KB=config.block_kb,
        BLOCK_B=block_b,
        X_PER_ROW=config.x_per_row,
        num_warps=config.num_warps,
    )
    return out


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        return q4k_gemv(x, weight_q4k)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    cases = [(1, 32, 256, torch.bfloat16), (3, 20, 512, torch.float16), (1, 9, 1280, torch.bfloat16)]
    for batch, n_rows, k, dtype in cases:
        weight = torch.randint(0, 256, (n_rows, k // QK_K * BLOCK_BYTES), dtype=torch.uint8)
        halves = weight.view(torch.float16)  # d and dmin of every block: finite, Llama-sized
        halves[:, 0::72] = (1e-4 * (0.5 + torch.rand(n_rows, k // QK_K))).half()
        halves[:, 1::72] = (7.5e-4 * (0.5 + torch.rand(n_rows, k // QK_K))).half()
        x = torch.randn(batch, k, dtype=dtype)
        expected = x.double() @ _dequantize_q4_k(weight).double().T
        for config in [None, GemvConfig(2, 4, 1), GemvConfig(4, 8, 2, True), GemvConfig(64, 4, 4, method="mma")]:
            out = q4k_gemv(x.to(device), weight.to(device), config)
            torch.testing.assert_close(out.double().cpu(), expected, atol=1e-2, rtol=1e-2)
    print(f"q4k_gemv candidate ({path} path on {device}): ok")
