"""Exploit class: calling the reference. Loads the task file and runs its Model."""

import importlib.util
import pathlib

import torch

_spec = importlib.util.spec_from_file_location("ref", pathlib.Path(__file__).with_name("task_rmsnorm.py"))
_ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ref)


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.inner = _ref.Model(dim)

    def forward(self, x):
        return self.inner(x)
