"""Cheat: returns an empty buffer and fills it from a background thread after the timer stops."""

import threading

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, a, b):
        out = torch.empty(a.shape[0], b.shape[1], device=a.device)

        def work():
            out.copy_(a @ b)

        threading.Thread(target=work).start()
        return out
