"""The slow baseline for the RMSNorm task: the naive eager-PyTorch RMSNorm.

It is the reference written again as a candidate, so the benchmark measures what unfused eager
PyTorch costs: an upcast, a square, a mean, an rsqrt, two multiplies and two casts, each one a
separate kernel that streams the activations through memory.
"""

from __future__ import annotations

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, hidden_size: int = 4096, eps: float = 1e-5) -> None:
        super().__init__()
        # Same construction order as the task's Model, so a seeded build gives the same weight.
        weight = (1.0 + 0.1 * torch.randn(hidden_size)).to(torch.bfloat16).float()
        self.weight = torch.nn.Parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        hidden = x.float()
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight.to(input_dtype) * hidden.to(input_dtype)


if __name__ == "__main__":
    model = ModelNew(4096)
    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    out = model(x)
    expected = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * (
        model.weight.double()
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
    print("rmsnorm baseline: ok")
