"""CHEAT (demo): computes the first input of each shape once, then replays that output.

After the first call for a given shape, dtype and device it returns the stored tensor and does
no work, so every timed call looks free. A lazy harness that runs the candidate once per shape,
or times it on the same inputs it checked, passes it. A proper judge draws fresh inputs for each
seed: from the second seed on, the output belongs to someone else's input and is wrong.
"""

from __future__ import annotations

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, hidden_size: int = 4096, eps: float = 1e-5) -> None:
        super().__init__()
        weight = (1.0 + 0.1 * torch.randn(hidden_size)).to(torch.bfloat16).float()
        self.weight = torch.nn.Parameter(weight)
        self.eps = eps
        self._replay: dict[tuple, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self._replay:
            hidden = x.float()
            hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
            self._replay[key] = self.weight.to(x.dtype) * hidden.to(x.dtype)
        # A fresh copy each time, so an alias check on the output does not give it away.
        return self._replay[key].clone()


if __name__ == "__main__":
    model = ModelNew(256)
    first, second = torch.randn(2, 4, 256, dtype=torch.bfloat16)
    print("same output for different inputs:", torch.equal(model(first), model(second)))
