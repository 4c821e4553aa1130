"""Exploit class: background thread finishing late. Returns at once; a thread fills the output
after the timer would have stopped."""

import threading
import time

import torch


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.zeros_like(x)

        def finish():
            time.sleep(0.005)
            out.copy_(torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6))

        threading.Thread(target=finish).start()
        return out
