"""Rotary position embedding (RoPE) on the query and key heads, Llama-3 style.

Llama-3 rotates pairs (i, i + head_dim/2) of each head (the "rotate_half", NeoX layout that Hugging
Face and vLLM use) by angle position * theta^(-2i/head_dim), with theta = 500000. Inputs are the
token positions [tokens] (int64) and q [tokens, q_heads, head_dim], k [tokens, kv_heads,
head_dim]; the output is the rotated (q, k), new tensors in the input dtype.

The reference is the Hugging Face formula `x * cos + rotate_half(x) * sin`, computed in fp32
and rounded once. (Hugging Face rounds cos/sin and each product to bf16 first; that reference
is itself up to several bf16 ulps from the exact result where the two products cancel, which
would fail correct fp32 kernels at a 1e-2 tolerance.) The angle is the fp32 product
float(position) * inv_freq, with inv_freq a buffer computed once as Hugging Face does, and it
stays fp32 when the judge runs this module in float64: at position 131071 an fp32 angle is up
to 0.008 rad from the float64 one, so the angle's precision is part of the definition. A
kernel that reuses the buffer gets bitwise the same angles.

Decode rows are one token per sequence at scattered positions (up to 8k, and up to 128k for
Llama-3.1's long context); prefill rows are consecutive positions, from 0 or continuing a
context (chunked prefill).

KernelBench-compatible: `Model`, `get_inputs()`, `get_init_inputs()`. Loom extensions: `SHAPES`,
`TOLERANCE`, `flops`, `bytes_moved`.
"""

from __future__ import annotations

import torch

ROPE_THETA = 500000.0  # Llama-3's rope_theta

# Llama-3-8B: 32 query heads, 8 key/value heads, head_dim 128.
SHAPES: list[dict] = [
    {"name": "decode_t1_ctx8k", "tokens": 1, "context": 8192, "mode": "decode"},
    {"name": "decode_t8_ctx8k", "tokens": 8, "context": 8192, "mode": "decode"},
    {"name": "decode_t64_ctx128k", "tokens": 64, "context": 131072, "mode": "decode"},
    {"name": "prefill_t512", "tokens": 512, "context": 512, "mode": "prefill"},
    {"name": "prefill_t4096", "tokens": 4096, "context": 4096, "mode": "prefill"},
    {"name": "tail_chunk_t1023_ctx4096", "tokens": 1023, "context": 4096, "mode": "prefill"},
    {
        "name": "prefill_t512_fp16",
        "tokens": 512,
        "context": 512,
        "mode": "prefill",
        "dtype": "float16",
    },
    {
        "name": "decode_t8_ctx128k_fp32",
        "tokens": 8,
        "context": 131072,
        "mode": "decode",
        "dtype": "float32",
    },
]

TOLERANCE: dict[str, dict[str, float]] = {
    "bfloat16": {"atol": 1e-2, "rtol": 1e-2},
    "float16": {"atol": 1e-2, "rtol": 1e-2},
    "float32": {"atol": 1e-5, "rtol": 1e-5},
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Model(torch.nn.Module):
    def __init__(self, head_dim: int = 128, rope_theta: float = ROPE_THETA) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (rope_theta**exponents))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 angles whatever the module's dtype, as Hugging Face forces with autocast off.
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [tokens, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        q32, k32 = q.float(), k.float()
        q_rotated = q32 * cos + rotate_half(q32) * sin
        k_rotated = k32 * cos + rotate_half(k32) * sin
        return q_rotated.to(q.dtype), k_rotated.to(k.dtype)


def get_inputs(
    tokens: int = 8,
    context: int = 8192,
    mode: str = "decode",
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    **_: object,
) -> list:
    if mode == "decode":
        positions = torch.randint(0, context, (tokens,))  # one token per sequence
    else:
        positions = torch.arange(context - tokens, context)  # the last `tokens` of the context
    torch_dtype = getattr(torch, dtype)
    q = torch.randn(tokens, q_heads, head_dim, dtype=torch_dtype)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=torch_dtype)
    return [positions, q, k]


def get_init_inputs(head_dim: int = 128, **_: object) -> list:
    return [head_dim, ROPE_THETA]


def flops(
    tokens: int = 8, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128, **_: object
) -> float:
    # two multiplies and an add per output element (cos/sin are per token and frequency)
    return 3.0 * tokens * (q_heads + kv_heads) * head_dim


def bytes_moved(
    tokens: int = 8,
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "bfloat16",
    **_: object,
) -> float:
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    heads = 2.0 * tokens * (q_heads + kv_heads) * head_dim * element  # q, k read and written
    return heads + 8.0 * tokens + 4.0 * head_dim / 2  # positions (int64), inv_freq (fp32)


if __name__ == "__main__":
    positions, q, k = get_inputs(tokens=3, context=131072, q_heads=4, kv_heads=2)
    q_rotated, k_rotated = Model()(positions, q, k)
    print(
        f"reference: positions {positions.tolist()} q {tuple(q.shape)} -> {tuple(q_rotated.shape)}"
    )
    for shape in SHAPES:
        print(
            f"{shape['name']:>26}: {flops(**shape) / 1e6:9.2f} MFLOP {bytes_moved(**shape) / 1e6:9.2f} MB"
        )
