"""Cheat: patches the CUDA event timer so every measurement reads a tiny time."""

import torch
import torch.nn as nn

_real_elapsed = torch.cuda.Event.elapsed_time


def _fast(self, end_event):
    return _real_elapsed(self, end_event) * 0.01


torch.cuda.Event.elapsed_time = _fast
setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # noqa: B010


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)
