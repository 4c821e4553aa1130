"""Row softmax over the last dimension: sampling over a vocabulary, or one attention row.

The reference is the plain PyTorch people write in sampling code: upcast the logits to fp32,
`torch.softmax`, cast back. That is three kernels and an fp32 copy of the input in memory; a
fused kernel reads the row and writes the probabilities, so the roofline is `bytes_moved`.

Rows are Llama-3's vocabulary (128256 logits, larger than one program's registers, so a kernel
has to loop over the row) and 4096-wide rows (one block), plus tails: Llama-2's 32000-token
vocabulary, a 4000-wide row and 1023 rows.

KernelBench-compatible: `Model`, `get_inputs()`, `get_init_inputs()`. Loom extensions: `SHAPES`,
`TOLERANCE`, `flops`, `bytes_moved`.
"""

from __future__ import annotations

import torch

SHAPES: list[dict] = [
    {"name": "sample_t1_v128256", "rows": 1, "cols": 128256},
    {"name": "sample_t8_v128256", "rows": 8, "cols": 128256},
    {"name": "sample_t64_v128256", "rows": 64, "cols": 128256},
    {"name": "sample_t8_v128256_fp32", "rows": 8, "cols": 128256, "dtype": "float32"},
    {"name": "sample_t8_v128256_fp16", "rows": 8, "cols": 128256, "dtype": "float16"},
    {"name": "sample_t8_v32000", "rows": 8, "cols": 32000},
    {"name": "rows_t512_n4096", "rows": 512, "cols": 4096},
    {"name": "rows_t4096_n4096", "rows": 4096, "cols": 4096},
    {"name": "rows_t16384_n4096", "rows": 16384, "cols": 4096},
    {"name": "tail_t1023_n4000", "rows": 1023, "cols": 4000},
    {"name": "rows_t512_n4096_fp16", "rows": 512, "cols": 4096, "dtype": "float16"},
]

# Probabilities over 128k entries are ~1e-5 each, so the usual atol of 1e-2 would pass an
# all-zero output. Agreement is relative (one rounding of the same fp32 value is at most 1 ulp
# apart); the small atol only covers fp16 subnormals below 6e-5, spaced 6e-8 apart.
TOLERANCE: dict[str, dict[str, float]] = {
    "bfloat16": {"atol": 1e-6, "rtol": 1e-2},
    "float16": {"atol": 1e-6, "rtol": 1e-2},
    "float32": {"atol": 1e-8, "rtol": 1e-4},
}


class Model(torch.nn.Module):
    """softmax(x) along the last dimension, computed in fp32, returned in x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.float(), dim=-1).to(x.dtype)


def get_inputs(rows: int = 8, cols: int = 128256, dtype: str = "bfloat16", **_: object) -> list:
    # Logits of a trained LM spread over a few units; randn * 4 gives probabilities that span
    # about ten orders of magnitude, like real ones.
    return [(4.0 * torch.randn(rows, cols)).to(getattr(torch, dtype))]


def get_init_inputs(**_: object) -> list:
    return []


def flops(rows: int = 8, cols: int = 128256, **_: object) -> float:
    # max, subtract, exp, sum, divide: five per element
    return 5.0 * rows * cols


def bytes_moved(rows: int = 8, cols: int = 128256, dtype: str = "bfloat16", **_: object) -> float:
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2.0 * rows * cols * element


if __name__ == "__main__":
    x = get_inputs(rows=3, cols=1000)[0]
    out = Model()(x)
    print(f"reference: {tuple(x.shape)} {x.dtype} -> {tuple(out.shape)} {out.dtype}")
    for shape in SHAPES:
        print(
            f"{shape['name']:>26}: {flops(**shape) / 1e6:9.2f} MFLOP {bytes_moved(**shape) / 1e6:9.2f} MB"
        )
