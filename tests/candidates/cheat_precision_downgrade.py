"""Cheat: runs an fp32 matmul in half precision and TF32."""

import torch
import torch.nn as nn

torch.backends.cuda.matmul.allow_tf32 = True
torch.set_float32_matmul_precision("medium")


class ModelNew(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a.half(), b.to(torch.float16)).float()
