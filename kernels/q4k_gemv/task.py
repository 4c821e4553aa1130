"""Decode GEMV on GGUF Q4_K weights: y = x @ W.T with W stored as packed Q4_K bytes.

This is the matrix-vector product that dominates a llama.cpp-style decode step: the weight is
read once per token batch, 0.5625 bytes per weight, and the kernel is bound by that read.

Inputs: x [batch, K] (bf16 or fp16, batch 1..8: decode) and W as a uint8 tensor
[N, K / 256 * 144], each row a run of 144-byte Q4_K blocks exactly as a GGUF file stores the
tensor (see kernels/q4k/format.py for the layout). Output: y [batch, N] in x's dtype.

The reference dequantizes W with the `gguf` package's dequantizer (gguf-py, which matches
llama.cpp's C bit for bit) into float32 and multiplies in float64, then rounds to x's dtype.
It runs numpy on the CPU for the dequantization, which is fine for a reference and far too slow
for anything else.

The weights are random valid Q4_K blocks (every 6-bit scale and min pattern and every code),
not a quantized matrix: that covers the format's corners better than any one quantizer's
output, and costs nothing to draw at 14336 x 4096. x is drawn from torch's global RNG; the
judge's stressed variants (heavy tails, scales) apply to x only.

Shapes: Llama-3-8B's projections (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down
4096x14336) at batch 1 and 8, plus small ones that the CPU interpreter can run and one with an
odd row count.

KernelBench-compatible: `Model`, `get_inputs()`, `get_init_inputs()`. Loom extensions: `SHAPES`,
`TOLERANCE`, `check`, `BASELINE`, `flops`, `bytes_moved`. Needs `pip install gguf`.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

QK_K = 256  # weights per Q4_K block

# The Model is a CPU oracle (numpy dequantization, float64 product): correct, and far too slow to
# be a speed reference. The benchmark times baseline.py, the plain-PyTorch path, instead.
BASELINE = "baseline.py"
# The Model already multiplies in float64 and rounds once: the judge's own float64 rerun of it
# would repeat the slowest part of validation for the same numbers.
REFERENCE_PRECISION = "native"
BLOCK_BYTES = 144  # bytes per Q4_K block

SHAPES: list[dict] = [
    {"name": "q_proj_b1_4096x4096", "batch": 1, "n": 4096, "k": 4096},
    {"name": "q_proj_b8_4096x4096", "batch": 8, "n": 4096, "k": 4096},
    {"name": "kv_proj_b1_1024x4096", "batch": 1, "n": 1024, "k": 4096},
    {"name": "kv_proj_b8_1024x4096", "batch": 8, "n": 1024, "k": 4096},
    {"name": "gate_up_b1_14336x4096", "batch": 1, "n": 14336, "k": 4096},
    {"name": "gate_up_b8_14336x4096", "batch": 8, "n": 14336, "k": 4096},
    {"name": "down_b1_4096x14336", "batch": 1, "n": 4096, "k": 14336},
    {"name": "down_b8_4096x14336", "batch": 8, "n": 4096, "k": 14336},
    {"name": "q_proj_b4_4096x4096_fp16", "batch": 4, "n": 4096, "k": 4096, "dtype": "float16"},
    {"name": "small_b1_256x512", "batch": 1, "n": 256, "k": 512},
    {"name": "small_tail_b3_100x768", "batch": 3, "n": 100, "k": 768},
]

# For tools that want plain numbers. A kernel that keeps dequantized weights in fp32 and
# accumulates in fp32 differs from the float64 reference by well under 1e-5 relative before
# the output rounding. The judge calls `check` below.
TOLERANCE: dict[str, dict[str, float]] = {
    "bfloat16": {"atol": 1e-2, "rtol": 1e-2},
    "float16": {"atol": 1e-2, "rtol": 1e-2},
}


def check(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """|out - ref| <= 1 % of the RMS of ref's row + 1 % of |ref|, everywhere; NaN and inf
    where ref has them.

    Scale-aware, because tensor cores (TF32, fp16) round weights and activations to 10-11
    bits: about 1e-3 of an output row's RMS, an error that grows with x, so no single atol
    holds at x * 64 and at x * 1e-3 both. fp32 CUDA-core kernels sit far inside it. Dropping
    one 32-weight sub-block of K = 4096 moves outputs by about 9 % of the row's RMS: partial
    work still fails."""
    got, want = out.double(), ref.double()
    if not torch.equal(torch.isnan(got), torch.isnan(want)):
        return False
    finite = torch.isfinite(want)
    if not torch.equal(got[~finite], want[~finite]):
        return False
    got, want = torch.where(finite, got, 0.0), torch.where(finite, want, 0.0)
    if want.numel() == 0:
        return True
    row_rms = want.reshape(-1, want.shape[-1]).square().mean(dim=-1).sqrt()
    bound = 1e-2 * row_rms.reshape(*want.shape[:-1], 1) + 1e-2 * want.abs()
    return bool(((got - want).abs() <= bound).all())


class Model(torch.nn.Module):
    """y = x @ dequantize_q4_k(W).T, via gguf-py's dequantizer and a float64 product."""

    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        weight = dequantize(weight_q4k.cpu().numpy(), GGMLQuantizationType.Q4_K)
        weight = torch.from_numpy(weight).to(device=x.device, dtype=torch.float64)
        return (x.double() @ weight.T).to(x.dtype)


def random_q4_k(rows: int, cols: int) -> torch.Tensor:
    """Random valid Q4_K bytes [rows, cols / 256 * 144] from torch's global RNG.

    Scales, mins and codes are random bytes; d and dmin are finite fp16 values around 1e-4 and
    7.5e-4, which gives Llama-sized weights (|w| up to ~0.1, mean near 0). The same generator
    as kernels/q4k/format.py's, repeated so this file stands alone.
    """
    n_blocks = cols // QK_K
    blocks = torch.randint(0, 256, (rows, n_blocks, BLOCK_BYTES), dtype=torch.uint8)
    d = 1e-4 * (0.5 + torch.rand(rows, n_blocks))
    dmin = 7.5e-4 * (0.5 + torch.rand(rows, n_blocks))
    blocks[..., 0:2] = d.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    blocks[..., 2:4] = dmin.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * BLOCK_BYTES)


def get_inputs(
    batch: int = 1, n: int = 4096, k: int = 4096, dtype: str = "bfloat16", **_: object
) -> list:
    if k % QK_K:
        raise ValueError(f"K must be a multiple of {QK_K} (whole Q4_K blocks), got {k}")
    x = torch.randn(batch, k, dtype=getattr(torch, dtype))
    return [x, random_q4_k(n, k)]


def get_init_inputs(**_: object) -> list:
    return []


def flops(batch: int = 1, n: int = 4096, k: int = 4096, **_: object) -> float:
    return 2.0 * batch * n * k  # the dequantization is not counted


def bytes_moved(
    batch: int = 1, n: int = 4096, k: int = 4096, dtype: str = "bfloat16", **_: object
) -> float:
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    weight = n * (k // QK_K) * BLOCK_BYTES  # 0.5625 bytes per weight
    return weight + batch * k * element + batch * n * element


if __name__ == "__main__":
    x, weight_q4k = get_inputs(batch=2, n=64, k=512)
    y = Model()(x, weight_q4k)
    print(
        f"reference: x {tuple(x.shape)} W {tuple(weight_q4k.shape)} uint8 -> {tuple(y.shape)} {y.dtype}"
    )
    for shape in SHAPES:
        print(
            f"{shape['name']:>26}: {flops(**shape) / 1e6:9.2f} MFLOP {bytes_moved(**shape) / 1e6:9.2f} MB"
        )
