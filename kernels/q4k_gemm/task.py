"""Prefill GEMM on GGUF Q4_K weights: Y = X @ W.T for a batch of M prompt tokens.

The same weights as the `q4k_gemv` task (uint8 [N, K / 256 * 144], GGUF Q4_K blocks), now
multiplied by M = 16 .. 2048 token rows at once: prefill. From M of about 60 the product is
bound by arithmetic, not by the weight read, so a fast kernel dequantizes the weights to a
tensor-core type and runs a dense matmul; the question is how little that dequantization costs.

Inputs: x [M, K] bf16, W uint8 [N, K / 256 * 144]. Output: [M, N] bf16.

Reference: gguf-py's dequantizer (an oracle we did not write) to float64, then a float64
product, rounded to bf16.

Tolerance: tensor cores multiply bf16 (or fp16) weights, and rounding a Q4_K weight to bf16
moves it by up to 2^-9 of itself: an error that scales with the output row, which an absolute
tolerance cannot follow across the input scales the judge tries (x times 1e-3, x times 64,
heavy tails). So `check` bounds the error by 2 % of the RMS of the reference's output row plus
1 % of each value; bf16 weights measured up to 0.74 of that bound with heavy-tailed x (CPU,
256 x 2048 x 4096). Dropping one 32-weight sub-block of K = 4096 moves outputs by about 9 % of
the row's RMS, so partial work still fails.

KernelBench-compatible: `Model`, `get_inputs()`, `get_init_inputs()`. Loom extensions: `SHAPES`,
`TOLERANCE`, `check`, `flops`, `bytes_moved`. Needs `pip install gguf`.
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
    {"name": "m16_gate_up_14336x4096", "m": 16, "n": 14336, "k": 4096},
    {"name": "m64_gate_up_14336x4096", "m": 64, "n": 14336, "k": 4096},
    {"name": "m256_down_4096x14336", "m": 256, "n": 4096, "k": 14336},
    {"name": "m1024_q_4096x4096", "m": 1024, "n": 4096, "k": 4096},
    {"name": "m2048_gate_up_14336x4096", "m": 2048, "n": 14336, "k": 4096},
    {"name": "m2048_down_4096x14336", "m": 2048, "n": 4096, "k": 14336},
    {"name": "small_m5_96x512", "m": 5, "n": 96, "k": 512},
]


# For tools that want plain numbers: roughly the bound `check` gives at unit input scale
# (outputs of RMS ~5 for these weights). The judge calls `check`, which scales with the input.
TOLERANCE: dict[str, dict[str, float]] = {
    "bfloat16": {"atol": 5e-2, "rtol": 1e-2},
    "float16": {"atol": 5e-2, "rtol": 1e-2},
}


def check(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """|out - ref| <= 2 % of the RMS of ref's row + 1 % of |ref|, everywhere; NaN and inf where
    ref has them. Per row, because a token row with heavy-tailed x has larger values and
    larger rounding errors than the others."""
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
    bound = 2e-2 * row_rms.reshape(*want.shape[:-1], 1) + 1e-2 * want.abs()
    return bool(((got - want).abs() <= bound).all())


class Model(torch.nn.Module):
    """Y = x @ dequantize_q4_k(W).T, via gguf-py's dequantizer and a float64 product."""

    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        weight = dequantize(weight_q4k.cpu().numpy(), GGMLQuantizationType.Q4_K)
        weight = torch.from_numpy(weight).to(device=x.device, dtype=torch.float64)
        return (x.double() @ weight.T).to(x.dtype)


def random_q4_k(rows: int, cols: int) -> torch.Tensor:
    """Random valid Q4_K bytes [rows, cols / 256 * 144] from torch's global RNG: every scale,
    min and code pattern, with finite fp16 d around 1e-4 and dmin around 7.5e-4."""
    n_blocks = cols // QK_K
    blocks = torch.randint(0, 256, (rows, n_blocks, BLOCK_BYTES), dtype=torch.uint8)
    d = 1e-4 * (0.5 + torch.rand(rows, n_blocks))
    dmin = 7.5e-4 * (0.5 + torch.rand(rows, n_blocks))
    blocks[..., 0:2] = d.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    blocks[..., 2:4] = dmin.half().view(torch.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * BLOCK_BYTES)


def get_inputs(
    m: int = 64, n: int = 4096, k: int = 4096, dtype: str = "bfloat16", **_: object
) -> list:
    if k % QK_K:
        raise ValueError(f"K must be a multiple of {QK_K} (whole Q4_K blocks), got {k}")
    return [torch.randn(m, k, dtype=getattr(torch, dtype)), random_q4_k(n, k)]


def get_init_inputs(**_: object) -> list:
    return []


def flops(m: int = 64, n: int = 4096, k: int = 4096, **_: object) -> float:
    return 2.0 * m * n * k  # the dequantization is not counted


def bytes_moved(m: int = 64, n: int = 4096, k: int = 4096, **_: object) -> float:
    return n * (k // QK_K) * BLOCK_BYTES + 2 * m * k + 2 * m * n


if __name__ == "__main__":
    x, w = get_inputs(m=3, n=64, k=512)
    y = Model()(x, w)
    print(f"reference: x {tuple(x.shape)} W {tuple(w.shape)} uint8 -> {tuple(y.shape)} {y.dtype}")
    assert check(y, y) and not check(y * 1.05, y)
