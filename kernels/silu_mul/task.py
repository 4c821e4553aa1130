"""SwiGLU's gate: out = silu(gate) * up, the activation between Llama's MLP projections.

Layout: one input tensor [tokens, 2 * intermediate] holding gate and up side by side, the way a
fused gate_up projection (one GEMM with both weights concatenated, as vLLM and TensorRT-LLM run
it) returns them; gate is the first half of each row, up the second. The output is
[tokens, intermediate]. Eager PyTorch runs silu and the multiply as separate kernels with an
intermediate in memory; a fused kernel reads the input once and writes the output once.

The reference is the plain PyTorch people write (vLLM's `SiluAndMul.forward_native`), in the
activation dtype: silu is computed in fp32 internally and rounded, then multiplied by up and
rounded again.

KernelBench-compatible: `Model`, `get_inputs()`, `get_init_inputs()`. Loom extensions: `SHAPES`,
`TOLERANCE`, `flops`, `bytes_moved`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Llama-3-8B's intermediate size 14336 at decode (1, 8 tokens) and prefill (512, 4096), plus
# tails: 1023 tokens, Llama-2-7B's 11008 and Qwen2.5-7B's 18944, neither a multiple of 1024.
SHAPES: list[dict] = [
    {"name": "decode_t1_i14336", "tokens": 1, "intermediate": 14336},
    {"name": "decode_t8_i14336", "tokens": 8, "intermediate": 14336},
    {"name": "prefill_t512_i14336", "tokens": 512, "intermediate": 14336},
    {"name": "prefill_t4096_i14336", "tokens": 4096, "intermediate": 14336},
    {"name": "tail_t1023_i14336", "tokens": 1023, "intermediate": 14336},
    {"name": "tail_t8_i11008", "tokens": 8, "intermediate": 11008},
    {"name": "tail_t512_i18944", "tokens": 512, "intermediate": 18944},
    {"name": "prefill_t512_i14336_fp16", "tokens": 512, "intermediate": 14336, "dtype": "float16"},
    {"name": "decode_t8_i14336_fp32", "tokens": 8, "intermediate": 14336, "dtype": "float32"},
]

# Judged against this module run in float64. The reference rounds twice (after silu, after the
# multiply): at most 2 x 0.39 % from exact in bf16, inside 1e-2; a fused kernel rounds once.
TOLERANCE: dict[str, dict[str, float]] = {
    "bfloat16": {"atol": 1e-2, "rtol": 1e-2},
    "float16": {"atol": 1e-2, "rtol": 1e-2},
    "float32": {"atol": 1e-5, "rtol": 1e-5},
}


class Model(torch.nn.Module):
    """out = silu(gate_up[..., :I]) * gate_up[..., I:]."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        intermediate = gate_up.shape[-1] // 2
        return F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]


def get_inputs(
    tokens: int = 8, intermediate: int = 14336, dtype: str = "bfloat16", **_: object
) -> list:
    return [torch.randn(tokens, 2 * intermediate, dtype=getattr(torch, dtype))]


def get_init_inputs(**_: object) -> list:
    return []


def flops(tokens: int = 8, intermediate: int = 14336, **_: object) -> float:
    # silu as x / (1 + exp(-x)) is four (negate, exp, add, divide), then the multiply by up
    return 5.0 * tokens * intermediate


def bytes_moved(
    tokens: int = 8, intermediate: int = 14336, dtype: str = "bfloat16", **_: object
) -> float:
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # gate and up read once, the product written once
    return 3.0 * tokens * intermediate * element


if __name__ == "__main__":
    gate_up = get_inputs(tokens=3, intermediate=300)[0]
    out = Model()(gate_up)
    print(f"reference: {tuple(gate_up.shape)} {gate_up.dtype} -> {tuple(out.shape)} {out.dtype}")
    for shape in SHAPES:
        print(
            f"{shape['name']:>26}: {flops(**shape) / 1e6:9.2f} MFLOP {bytes_moved(**shape) / 1e6:9.2f} MB"
        )
