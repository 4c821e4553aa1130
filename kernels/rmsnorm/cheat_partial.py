"""CHEAT (demo): normalizes only the first half of the rows; the rest pass through unnormalized.

It does half the work, so it looks about twice as fast. A lazy harness that checks one decode
shape (a single token) sees ceil(1 / 2) = 1 row, all of it normalized, and passes it. A proper
judge fails it on the first shape with two or more tokens: every row in the second half is off.
"""

from __future__ import annotations

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, hidden_size: int = 4096, eps: float = 1e-5) -> None:
        super().__init__()
        weight = (1.0 + 0.1 * torch.randn(hidden_size)).to(torch.bfloat16).float()
        self.weight = torch.nn.Parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        half = (rows.shape[0] + 1) // 2
        out = rows.clone()
        head = rows[:half].float()
        head = head * torch.rsqrt(head.pow(2).mean(-1, keepdim=True) + self.eps)
        out[:half] = self.weight.to(x.dtype) * head.to(x.dtype)
        return out.reshape(x.shape)


if __name__ == "__main__":
    model = ModelNew(256)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    out = model(x)
    print("rows left unnormalized:", int((out == x).all(-1).sum()), "of", x.shape[0])
