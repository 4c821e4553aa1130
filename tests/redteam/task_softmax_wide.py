"""Red-team task: softmax over wide rows of soft-capped scores, fp32 and bf16.

The scores are capped to [-1, 1] (cap * tanh(x / cap), Gemma-style soft-capping with cap 1), so
whatever the input kind every probability lies within a factor e^2 of 1/cols: below 1e-4 at 32k
columns. An elementwise atol of 1e-4 (fp32) or 1e-2 (bf16) alone would accept all zeros here.
Few rows, so the CPU is quick."""

import torch

SHAPES = [
    {"name": "rows4_n32768", "rows": 4, "cols": 32768},
    {"name": "rows3_n30000", "rows": 3, "cols": 30000},
    {"name": "rows4_n32768_bf16", "rows": 4, "cols": 32768, "dtype": "bfloat16"},
]

CAP = 1.0


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(CAP * torch.tanh(x / CAP), dim=-1)


def get_inputs(rows: int = 4, cols: int = 32768, dtype: str = "float32"):
    return [torch.randn(rows, cols).to(getattr(torch, dtype))]


def get_init_inputs(**_):
    return []
