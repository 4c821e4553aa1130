"""RMSNorm over the hidden dimension, as Llama-3 applies it before attention and the MLP.

The reference is the plain PyTorch module people write (the Hugging Face `LlamaRMSNorm`
pattern): upcast to fp32, mean of squares, rsqrt, scale, cast back to the activation dtype,
then multiply by the weight in the activation dtype. Eager PyTorch runs that as five or six
kernels that each stream the activations through memory; a fused kernel reads x once and writes
the output once, so this task is bandwidth-bound and the roofline is `bytes_moved`.

KernelBench-compatible: `Model`, `get_inputs()`, `get_init_inputs()`. Loom extensions: `SHAPES`,
`TOLERANCE`, `flops`, `bytes_moved`.
"""

from __future__ import annotations

import torch

# Decode (1 and 8 tokens) and prefill (512, 4096 tokens; 16384 is the large size that the
# bandwidth target is stated at) at Llama-3-8B's hidden size, plus edge
# shapes: a token count that is not a power of two, and hidden sizes whose row does not fill a
# power-of-two block (4000) or needs a block twice as wide as 4096 (5120, Llama-2-13B).
SHAPES: list[dict] = [
    {"name": "decode_t1_h4096", "tokens": 1, "hidden": 4096},
    {"name": "decode_t8_h4096", "tokens": 8, "hidden": 4096},
    {"name": "prefill_t512_h4096", "tokens": 512, "hidden": 4096},
    {"name": "prefill_t4096_h4096", "tokens": 4096, "hidden": 4096},
    {"name": "prefill_t16384_h4096", "tokens": 16384, "hidden": 4096},
    {"name": "tail_t1023_h4096", "tokens": 1023, "hidden": 4096},
    {"name": "tail_t1023_h4000", "tokens": 1023, "hidden": 4000},
    {"name": "decode_t8_h5120", "tokens": 8, "hidden": 5120},
    {"name": "prefill_t512_h5120", "tokens": 512, "hidden": 5120},
    {"name": "prefill_t512_h4096_fp16", "tokens": 512, "hidden": 4096, "dtype": "float16"},
    {"name": "decode_t8_h4000_fp32", "tokens": 8, "hidden": 4000, "dtype": "float32"},
]

# Judged against this module run in float64. The reference itself rounds twice (after
# normalizing, after the weight multiply): at most 2 x 0.39 % from exact in bf16, inside 1e-2.
TOLERANCE: dict[str, dict[str, float]] = {
    "bfloat16": {"atol": 1e-2, "rtol": 1e-2},
    "float16": {"atol": 1e-2, "rtol": 1e-2},
    "float32": {"atol": 1e-4, "rtol": 1e-4},
}

EPS = 1e-5  # Llama-3's rms_norm_eps


class Model(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalized in fp32, returned in x's dtype."""

    def __init__(self, hidden_size: int = 4096, eps: float = EPS) -> None:
        super().__init__()
        # A trained norm weight is far from all-ones; a random one makes a candidate that skips
        # the multiply fail. Its values are bf16 ones, as in a bf16 checkpoint, so the cast in
        # forward is exact for bf16 and fp16; stored as fp32, one module serves every dtype.
        weight = (1.0 + 0.1 * torch.randn(hidden_size)).to(torch.bfloat16).float()
        self.weight = torch.nn.Parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        hidden = x.float()
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight.to(input_dtype) * hidden.to(input_dtype)


def get_inputs(tokens: int = 8, hidden: int = 4096, dtype: str = "bfloat16", **_: object) -> list:
    return [torch.randn(tokens, hidden, dtype=getattr(torch, dtype))]


def get_init_inputs(hidden: int = 4096, **_: object) -> list:
    return [hidden]


def flops(tokens: int = 8, hidden: int = 4096, **_: object) -> float:
    # square, accumulate, scale by rstd, multiply by weight: four per element
    return 4.0 * tokens * hidden


def bytes_moved(tokens: int = 8, hidden: int = 4096, dtype: str = "bfloat16", **_: object) -> float:
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    # x read once, y written once, the fp32 weight read once
    return 2.0 * tokens * hidden * element + 4.0 * hidden


if __name__ == "__main__":
    x = get_inputs(tokens=3, hidden=320)[0]
    y = Model(320)(x)
    print(f"reference: {tuple(x.shape)} {x.dtype} -> {tuple(y.shape)} {y.dtype}")
    for shape in SHAPES:
        print(
            f"{shape['name']:>26}: {flops(**shape) / 1e6:9.2f} MFLOP {bytes_moved(**shape) / 1e6:9.2f} MB"
        )
