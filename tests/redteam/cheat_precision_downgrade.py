"""Exploit class: precision downgrade. Computes in bfloat16 and casts back to float32."""

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        xb, wb = x.to(torch.bfloat16), self.weight.to(torch.bfloat16)
        return (xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + 1e-6) * wb).to(torch.float32)
