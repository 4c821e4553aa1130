"""Cheat: calls the CUDA runtime directly to create a stream the harness cannot see."""

import ctypes

import torch
import torch.nn as nn

_cudart = ctypes.CDLL("libcudart.so")
_stream = ctypes.c_void_p()
_cudart.cudaStreamCreate(ctypes.byref(_stream))


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)
