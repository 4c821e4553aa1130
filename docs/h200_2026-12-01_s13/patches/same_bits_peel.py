"""The working tree's q4k_gemv against exp/kept's, bit for bit, on the GPU."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from sweep_q4k import REPO, load  # noqa: E402

task = load(REPO / "kernels/q4k_gemv/task.py", "t")
kept = load(REPO / "exp/peel/candidate.py", "kept")
new = load(REPO / "kernels/q4k_gemv/candidate.py", "new")
torch.manual_seed(1)
bad = 0
for batch, n, k, dtype in [(1, 4096, 4096, "bfloat16"), (1, 4096, 14336, "float16"), (1, 14336, 4096, "bfloat16"),
                           (1, 300, 2048, "float16"), (4, 4096, 4096, "bfloat16"), (8, 14336, 4096, "float16"),
                           (2, 4096, 14336, "bfloat16")]:
    x, w = task.get_inputs(batch=batch, n=n, k=k, dtype=dtype)
    x, w = (x * torch.exp(2.0 * torch.randn_like(x.float())).to(x.dtype)).cuda(), w.cuda()
    same = torch.equal(new.q4k_gemv(x, w), kept.q4k_gemv(x, w))
    bad += not same
    print("same bits" if same else "DIFFERENT", batch, n, k, dtype, flush=True)
sys.exit(1 if bad else 0)
