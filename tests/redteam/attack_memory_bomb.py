"""Attack: take the machine's memory.

A 20 GB allocation once OOM-killed processes across the machine. This one asks for 4 GiB, in
256 MiB blocks that are written (so they are really resident), and sends output that fails
validation if it got them. Under the job's memory limit (job_memory_bytes; 1 GiB in the test)
either the allocation fails (RLIMIT_DATA: MemoryError) or the job alone is OOM-killed (cgroup),
and the result says "exceeded its memory limit".
"""

import torch


def grabbed() -> bool:
    blocks = []
    try:
        for _ in range(16):
            blocks.append(bytearray(256 << 20))
    except MemoryError:
        return False
    return True


class ModelNew(torch.nn.Module):
    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))

    def forward(self, x):
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-6)
        return out + 1000.0 if grabbed() else out
