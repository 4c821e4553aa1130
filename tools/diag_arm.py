#!/usr/bin/env python3
"""Drive one benchmark arm in-process on a 64M-element add (no sockets, no sandbox) and time
samples with and without input perturbation, plus the CPU cost of one eager call."""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("LOOM_RESULT_FD", "")
from loom_mcp.worker.bench import Arm  # noqa: E402

work = Path(tempfile.mkdtemp())
task = work / "t.py"
task.write_text("import torch\nclass Model(torch.nn.Module):\n    def forward(self, x, y):\n        return x + y\n")
N = 64 * 1024 * 1024
sets = [{"seed": i, "inputs": [torch.randn(N), torch.randn(N)], "init_inputs": [], "state_dict": {}} for i in range(2)]
torch.save({"shapes": [{"name": "add", "sets": sets}]}, work / "cases.pt")
for perturb in (False, True):
    arm = Arm({"role": "x", "module": str(task), "class_name": "Model", "cases_file": str(work / "cases.pt"),
               "device": "cuda", "flush_bytes": 256 << 20, "graph_below_s": 50e-6, "perturb": perturb})
    print("setup", arm.setup(0), flush=True)
    ts = [arm.sample(i % 2, [1, 2, 3], i)["t"] * 1e6 for i in range(40)]
    print("perturb", perturb, "median us", round(statistics.median(ts), 1), "min", round(min(ts), 1), flush=True)
model, x = arm.current["model"], arm.current["inputs"][0]
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(100):
    model(*x)
cpu = (time.perf_counter() - t0) / 100 * 1e6
torch.cuda.synchronize()
print("enqueue cost per call us (includes GPU backpressure)", round(cpu, 1))
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
arm.flush_buffer.zero_(); torch.cuda._sleep(20_000); s.record(); model(*x); e.record(); torch.cuda.synchronize()
print("manual", round(s.elapsed_time(e) * 1e3, 1))
