"""Exploit class: extra stream (GPU). Work goes to a side stream the timer never waits for."""

import torch

_SIDE = torch.cuda.Stream() if torch.cuda.is_available() else None


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.empty_like(x)
        with torch.cuda.stream(_SIDE):
            torch.cuda._sleep(2_000_000)
            out.copy_(torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6))
        return out
