"""Cheat: launches the work on a side stream the harness's end event does not wait for."""

import torch
import torch.nn as nn

_side = torch.cuda.Stream()


class ModelNew(nn.Module):
    def forward(self, a, b):
        with torch.cuda.stream(_side):
            return torch.matmul(a, b)
