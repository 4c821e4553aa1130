"""Red-team task: task_rmsnorm.py with a get_inputs slower than the timer draws per batch, so
the benchmark only perturbs its prepared sets (as for a task whose inputs are costly to make)."""

import time

import torch

SHAPES = [{"name": "rows8_d64", "rows": 8, "dim": 64}, {"name": "rows5_d37", "rows": 5, "dim": 37}]


class Model(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def get_inputs(rows: int = 8, dim: int = 64):
    time.sleep(0.1)  # the timer's FRESH_DRAW_MAX_S is 0.05
    return [torch.randn(rows, dim)]


def get_init_inputs(rows: int = 8, dim: int = 64):
    return [dim]
