"""Cheat: answers the harness's result pipe itself with a JSON array and exits 0 before the
harness can report, hoping the server trips over a result of the wrong shape."""

import os

import torch

from loom_mcp.worker import protocol


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        protocol.send_result([1])
        os._exit(0)
