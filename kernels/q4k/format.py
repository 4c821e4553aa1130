"""The GGUF Q4_K block format: layout, a numpy quantizer, random valid blocks, a dequantizer.

A Q4_K block packs 256 weights into 144 bytes (4.5 bits per weight), as llama.cpp's
`block_q4_K` (ggml-common.h) lays it out:

    bytes   0:2    d      fp16 super-scale
    bytes   2:4    dmin   fp16 super-min
    bytes   4:16   scales eight 6-bit sub-block scales and eight 6-bit sub-block mins
    bytes  16:144  qs     256 4-bit codes

Sub-block j (0..7) holds weights 32j..32j+31 and decodes as

    w = (d * sc[j]) * q - (dmin * m[j])        (float32, in that order of operations)

Scale and min packing (`get_scale_min_k4`): for j < 4, sc[j] = s[j] & 63 and m[j] = s[j+4] & 63;
for j >= 4 the low four bits sit in byte j+4 (scale in its low nibble, min in its high nibble)
and the top two bits in the top two bits of byte j-4 (scale) and byte j (min).

Code order: the 128 code bytes are four 32-byte chunks; byte l of chunk c holds weight
64c + l in its low nibble and weight 64c + 32 + l in its high nibble.

The reference dequantizer is gguf-py's (`gguf.quants.dequantize(data, GGMLQuantizationType.Q4_K)`,
checked against llama.cpp's C to the bit). gguf-py has no Q4_K quantizer, so `quantize_q4_k`
here is our own: per sub-block min/max, 6-bit scales and mins relative to d and dmin, codes
0..15. It writes valid Q4_K but is not byte-identical to llama.cpp's `quantize_row_q4_K_ref`,
which searches for better scales. `dequantize_q4_k` is a torch port of gguf-py's maths that
matches it bit for bit on any device (eager torch never fuses the multiply and subtract).

Self-check: `python format.py` (needs `pip install gguf`).
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256  # weights per block
SUB_BLOCK = 32  # weights per sub-block
SUB_BLOCKS = QK_K // SUB_BLOCK
SCALES_BYTES = 12
BLOCK_BYTES = 2 + 2 + SCALES_BYTES + QK_K // 2  # 144


# ---------------------------------------------------------------- 6-bit scales and mins


def pack_scales_mins(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """[..., 8] scales and [..., 8] mins, each 0..63, into the [..., 12] packed bytes."""
    sc = np.asarray(scales, dtype=np.uint8)
    m = np.asarray(mins, dtype=np.uint8)
    if sc.max(initial=0) > 63 or m.max(initial=0) > 63:
        raise ValueError("Q4_K scales and mins are 6-bit (0..63)")
    low, high = slice(0, 4), slice(4, 8)
    packed = np.empty((*sc.shape[:-1], SCALES_BYTES), dtype=np.uint8)
    packed[..., 0:4] = sc[..., low] | ((sc[..., high] >> 4) << 6)
    packed[..., 4:8] = m[..., low] | ((m[..., high] >> 4) << 6)
    packed[..., 8:12] = (sc[..., high] & 0x0F) | ((m[..., high] & 0x0F) << 4)
    return packed


def unpack_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The [..., 12] packed bytes into ([..., 8] scales, [..., 8] mins), each 0..63."""
    s = np.asarray(packed, dtype=np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, m


# ---------------------------------------------------------------- quantizer


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """Float weights [..., K] (K a multiple of 256) into Q4_K bytes [..., K / 256 * 144].

    Each 32-weight sub-block is mapped affinely onto codes 0..15 between min(x, 0) and max(x)
    (llama.cpp also clamps the min at 0, so the stored min offset is never negative). The
    sub-block steps and offsets are then quantized to 6 bits against the block's largest
    (d = max step / 63, dmin = max offset / 63, both stored as fp16), and the codes are
    computed against the quantized step and offset, so they round to the grid that will be
    decoded. Weights must be finite and below ~1e6 in magnitude (d is an fp16).
    """
    x = np.asarray(weights, dtype=np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"Q4_K rows must be a multiple of {QK_K} weights, got {x.shape[-1]}")
    if not np.isfinite(x).all():
        raise ValueError("Q4_K weights must be finite")
    lead = x.shape[:-1]
    sub = x.reshape(-1, SUB_BLOCKS, SUB_BLOCK)  # [blocks, 8, 32]

    low = np.minimum(sub.min(axis=-1), 0.0)
    # abs() only turns -0.0 into +0.0 (both are >= 0): a zero block must store d = dmin = +0.
    step = np.abs(sub.max(axis=-1) - low) / 15.0
    offset = np.abs(low)
    d = (step.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (offset.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]

    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(step / d32), 0.0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.rint(offset / dmin32), 0.0).clip(0, 63).astype(np.uint8)
        grid_step = (d32 * sc)[..., None]
        grid_offset = (dmin32 * m)[..., None]
        codes = np.where(grid_step > 0, np.rint((sub + grid_offset) / grid_step), 0.0)
    codes = codes.clip(0, 15).astype(np.uint8)

    blocks = np.empty((sub.shape[0], BLOCK_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    blocks[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    blocks[:, 4:16] = pack_scales_mins(sc, m)
    # Sub-blocks 2c and 2c+1 share chunk c: low nibbles and high nibbles.
    blocks[:, 16:] = (codes[:, 0::2, :] | (codes[:, 1::2, :] << 4)).reshape(-1, QK_K // 2)
    return blocks.reshape(*lead, -1)


# ---------------------------------------------------------------- random valid blocks


def random_q4_k(
    rows: int,
    cols: int,
    *,
    d_scale: float = 1e-4,
    dmin_scale: float = 7.5e-4,
    signed: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random valid Q4_K bytes [rows, cols / 256 * 144] from torch's RNG (or `generator`).

    Scales, mins and codes are uniform random bytes, so every 6-bit pattern (63 and 0xFF
    included) and every code appears; d and dmin are finite fp16 values drawn around d_scale
    and dmin_scale. The defaults give weights of Llama-like magnitude (|w| up to ~0.1, mean
    near 0: dmin = 7.5 d centres the mean code 7.5). `signed` flips the signs of d and dmin at
    random, which the format allows and llama.cpp never writes.
    """
    if cols % QK_K:
        raise ValueError(f"Q4_K rows must be a multiple of {QK_K} weights, got {cols}")
    n_blocks = cols // QK_K
    blocks = torch.randint(
        0, 256, (rows, n_blocks, BLOCK_BYTES), dtype=torch.uint8, generator=generator
    )
    d = d_scale * (0.5 + torch.rand(rows, n_blocks, generator=generator))
    dmin = dmin_scale * (0.5 + torch.rand(rows, n_blocks, generator=generator))
    if signed:
        d = d * (torch.randint(0, 2, d.shape, generator=generator) * 2 - 1)
        dmin = dmin * (torch.randint(0, 2, dmin.shape, generator=generator) * 2 - 1)
    blocks[..., 0:2] = d.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    blocks[..., 2:4] = dmin.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * BLOCK_BYTES)


# ---------------------------------------------------------------- dequantizers


def dequantize_q4_k(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K bytes [..., n * 144] (uint8) into float32 weights [..., n * 256], on packed's device.

    The same float32 operations in the same order as gguf-py, so the result is bit-identical.
    """
    if packed.dtype != torch.uint8 or packed.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"expected uint8 rows of whole {BLOCK_BYTES}-byte blocks")
    lead = packed.shape[:-1]
    blocks = packed.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [blocks, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    s = blocks[:, 4:16]
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    # Chunk c's low nibbles are sub-block 2c, its high nibbles 2c+1. (No tensor literal here:
    # copying one to the GPU inside forward would break CUDA-graph capture.)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, SUB_BLOCKS, SUB_BLOCK).float()
    step = (d * sc.float())[:, :, None]
    offset = (dmin * m.float())[:, :, None]
    return (step * codes - offset).reshape(*lead, -1)


def dequantize_q4_k_gguf(packed: np.ndarray | torch.Tensor) -> np.ndarray:
    """The reference: gguf-py's Q4_K dequantizer (float32 [..., n * 256])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = packed.cpu().numpy() if isinstance(packed, torch.Tensor) else np.asarray(packed)
    return dequantize(data, GGMLQuantizationType.Q4_K)


if __name__ == "__main__":
    weights = (0.02 * torch.randn(64, 1024)).numpy()
    packed = quantize_q4_k(weights)
    decoded = dequantize_q4_k_gguf(packed)
    rel_rmse = np.sqrt(np.mean((decoded - weights) ** 2) / np.mean(weights**2))
    print(f"quantize -> gguf dequantize: relative RMSE {rel_rmse:.4f}")
    random_blocks = random_q4_k(16, 512, signed=True)
    ours = dequantize_q4_k(random_blocks).numpy()
    assert np.array_equal(ours.view(np.uint32), dequantize_q4_k_gguf(random_blocks).view(np.uint32))
    print("torch dequantizer == gguf, bit for bit: ok")
