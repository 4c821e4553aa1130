"""A/B on the GPU: the batched kernel with rows 8 banks apart (working tree) against HEAD's."""
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from sweep_q4k import REPO, load, rotating_sets, time_rotating  # noqa: E402

rounds = int(os.environ.get("ROUNDS", "3"))
out_dir = Path(os.environ.get("OUT", "."))
task = load(REPO / "kernels/q4k_gemv/task.py", "t")
base = load(REPO / "kernels/q4k_gemv/baseline.py", "b")
kept = load(REPO / "exp/kept/candidate.py", "kept")
new = load(REPO / "kernels/q4k_gemv/candidate.py", "new")
result = {"device": torch.cuda.get_device_name(), "timings": []}
fails = 0
torch.manual_seed(0)
for batch in (2, 4, 8):
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]:
        def make(n=n, k=k, batch=batch):
            x, w = task.get_inputs(batch=batch, n=n, k=k)
            return x.cuda(), w.cuda()
        sets = rotating_sets(make, n * k // 256 * 144)
        x0, w0 = sets[0]
        kd = new.cuda_gemv_b1(x0.device)
        path = new.cuda_path(n, batch, kd.batched_ctas_per_sm(k // 256, batch))
        want = (x0.double() @ base.dequantize_q4_k(w0).double().T).to(x0.dtype)
        got, old = new.q4k_gemv(x0, w0), kept.q4k_gemv(x0, w0)
        ok = bool(task.check(got, want))
        same = bool(torch.equal(got, old))
        fails += not ok
        timed = [
            ("kept", lambda x, w: kept.q4k_gemv(x, w)),
            ("new", lambda x, w: new.q4k_gemv(x, w)),
            ("kept_pdl", lambda x, w: kept.q4k_gemv(x, w, constant_weight=True)),
            ("new_pdl", lambda x, w: new.q4k_gemv(x, w, constant_weight=True)),
        ]
        per = {name: [] for name, _ in timed}
        for r in range(rounds):
            for name, fn in timed[r % len(timed):] + timed[: r % len(timed)]:
                per[name].append(time_rotating(fn, sets, replays=30)[0] * 1e6)
        line = {"batch": batch, "shape": [n, k], "path": path, "ok": ok, "same_bits_as_kept": same}
        for name, _ in timed:
            line[name] = {"us": round(statistics.median(per[name]), 3), "rounds": [round(v, 3) for v in per[name]]}
        result["timings"].append(line)
        print(json.dumps({key: (v["us"] if isinstance(v, dict) else v) for key, v in line.items()}), flush=True)
        del sets
        torch.cuda.empty_cache()
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "ab_bn.json").write_text(json.dumps(result, indent=1))
print("failures", fails)
sys.exit(1 if fails else 0)
