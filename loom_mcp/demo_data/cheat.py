"""Demo cheat: normalizes only the first half of the rows and leaves the rest uninitialised.

Fast, and right on the rows a one-shape, one-seed check might look at; the judge must reject it.
"""

import torch

EPS = 1e-6


class ModelNew(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        half = max(1, x.shape[0] // 2)
        out[:half] = torch.nn.functional.rms_norm(x[:half], (x.shape[-1],), self.weight, eps=EPS)
        return out
