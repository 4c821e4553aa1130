"""Cheat: replays results stashed in shared memory by an earlier run."""

import os
import pickle

import torch
import torch.nn as nn

CACHE = "/dev/shm/loom_results.pkl"


class ModelNew(nn.Module):
    def forward(self, x):
        if os.path.exists(CACHE):
            with open(CACHE, "rb") as f:
                return pickle.load(f)
        out = torch.relu(x)
        torch.save(out, CACHE)
        return out
