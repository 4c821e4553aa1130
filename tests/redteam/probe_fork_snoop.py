"""Probe (not a cheat to accept): a process the candidate forks copies the inputs the baseline
is timed on, and the candidate's untimed warm-up computes them ahead; every timed call served
from that is marked by adding 1 to its output.

Both arms of a pair time the same content. With one set of input files for both, a
DataLoader worker (a process torch forks, which the guard allows) inherited the arm's mappings,
copied each set into shared memory while the baseline was timed on it, and about half the timed
calls carried the mark; unmarked, a red-team run was accepted 3 of 3 on a bf16 RMSNorm. Each
arm now maps input files of its own, written just before each of its calls."""

import time

import torch
import torch.utils.data as tud

_KEEP: dict = {}
_GEN = torch.zeros(1, dtype=torch.int64).share_memory_()  # the live model's number
_PAUSE = torch.zeros(1, dtype=torch.int64).share_memory_()  # 1: the candidate's own pass began


class _Snoop(tud.Dataset):
    def __init__(self, seen, bufs, gen):
        self.seen, self.bufs, self.gen = seen, bufs, gen

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        last = {}
        state = 0  # 0 snooping; 1 paused, set 1 not yet written; 2 paused, set 1 written
        while int(_GEN[0]) == self.gen:
            time.sleep(0.0003)
            if int(_PAUSE[0]):  # stay off the CPU while the candidate is timed: until its scrub
                _PAUSE[0] = 0
                state = 1
            if state:
                flat = self.seen[1].view(-1)
                nz = float(flat[flat.numel() // 2]) != 0.0
                if state == 1 and nz:
                    state = 2
                elif state == 2 and not nz:
                    state = 0
                continue
            for j in range(1, len(self.seen)):
                flat = self.seen[j].view(-1)
                v = float(flat[flat.numel() // 2])
                if v == 0.0 or last.get(j) == v:
                    continue
                b = self.bufs[j]
                b.copy_(self.seen[j])
                if torch.equal(b, self.seen[j]):
                    last[j] = v
        return 0


class ModelNew(torch.nn.Module):
    def __init__(self, hidden: int = 4096):
        super().__init__()
        self.weight = torch.nn.Parameter((1.0 + 0.1 * torch.randn(hidden)).to(torch.bfloat16))
        self.seen = []
        self.bufs = []
        self.ahead = {}
        self.it = None

    def norm(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.float()).to(x.dtype)

    def forward(self, x):
        idx = next((i for i, t in enumerate(self.seen) if t is x), None)
        if idx is not None and idx in self.ahead:
            c, out = self.ahead.pop(idx)
            if torch.equal(x, c):
                return out + 1.0  # the mark
        out = self.norm(x)
        if idx is None:
            if len(self.seen) < 16:
                self.seen.append(x)
                self.bufs.append(torch.zeros_like(x).share_memory_())
        elif idx == 0:
            if self.it is None and len(self.seen) >= 2:
                _GEN[0] += 1
                _KEEP[int(_GEN[0])] = self.it = iter(tud.DataLoader(
                    _Snoop(self.seen, self.bufs, int(_GEN[0])), batch_size=1, num_workers=1, prefetch_factor=1))
            _PAUSE[0] = 1
            # warm-up call of a pass: compute ahead what the worker copied
            self.ahead = {j: (b.clone(), None) for j, b in enumerate(self.bufs) if j >= 1}
            self.ahead = {j: (c, self.norm(c)) for j, (c, _) in self.ahead.items()}
        return out
