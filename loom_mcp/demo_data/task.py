"""Demo task: RMSNorm as careful eager code writes it: the mean of squares accumulated in float64,
then four more passes over the row.

KernelBench format plus loom's extensions (SHAPES, TOLERANCE, flops, bytes_moved).
"""

import torch

SHAPES = [
    {"name": "decode_t1_h4096", "tokens": 1, "hidden": 4096},
    {"name": "batch_t64_h4096", "tokens": 64, "hidden": 4096},
    {"name": "prefill_t512_h1024", "tokens": 512, "hidden": 1024},
    {"name": "tail_t37_h1000", "tokens": 37, "hidden": 1000},
]
TOLERANCE = {"float32": {"atol": 1e-4, "rtol": 1e-4}}
EPS = 1e-6


class Model(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean_square = x.double().pow(2).mean(-1, keepdim=True).to(x.dtype)
        normed = x * torch.rsqrt(mean_square + EPS)
        return normed * self.weight


def get_inputs(tokens: int = 64, hidden: int = 4096):
    return [torch.randn(tokens, hidden)]


def get_init_inputs(tokens: int = 64, hidden: int = 4096):
    return [hidden]


def flops(tokens: int = 64, hidden: int = 4096) -> float:
    return 4.0 * tokens * hidden


def bytes_moved(tokens: int = 64, hidden: int = 4096) -> float:
    return 4.0 * (2 * tokens * hidden + hidden)
