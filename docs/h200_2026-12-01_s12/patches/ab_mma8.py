"""A/B on the GPU: exp/mma8 (8 MMAs per block, x as two signed bytes) against HEAD's kernel."""
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
new = load(REPO / "exp/mma8/candidate.py", "mma8")
result = {"device": torch.cuda.get_device_name(), "checks": [], "timings": []}
fails = 0
torch.manual_seed(0)


def stressed(x, how):
    if how == "times64":
        return x * 64
    if how == "times1e-3":
        return x * 1e-3
    if how == "heavy_tails":
        return (x.float() * torch.exp(2.0 * torch.randn_like(x.float()))).to(x.dtype)
    if how == "zero_subblocks":
        x = x.clone()
        x.view(x.shape[0], -1, 32)[:, ::3] = 0
        return x
    return x


for batch, n, k, dtype, how in [
    (1, 4096, 4096, "bfloat16", "plain"), (1, 14336, 4096, "bfloat16", "plain"), (1, 4096, 14336, "bfloat16", "plain"),
    (1, 1024, 4096, "float16", "plain"), (1, 100, 768, "bfloat16", "plain"), (1, 9, 1280, "float16", "plain"),
    (1, 256, 512, "bfloat16", "times64"), (1, 4096, 4096, "bfloat16", "times1e-3"),
    (1, 4096, 4096, "bfloat16", "heavy_tails"), (1, 4096, 4096, "float16", "heavy_tails"),
    (1, 300, 2048, "bfloat16", "zero_subblocks"), (2, 4096, 4096, "bfloat16", "plain"),
    (4, 14336, 4096, "float16", "heavy_tails"), (8, 4096, 4096, "bfloat16", "plain"), (5, 4096, 14336, "bfloat16", "plain"),
    (3, 1024, 4096, "bfloat16", "times1e-3"),
]:
    x, w = task.get_inputs(batch=batch, n=n, k=k, dtype=dtype)
    x, w = stressed(x, how).cuda(), w.cuda()
    want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
    got, old = new.q4k_gemv(x, w), kept.q4k_gemv(x, w)
    got_pdl = new.q4k_gemv(x, w, constant_weight=True)
    torch.cuda.synchronize()
    ok = bool(task.check(got, want))
    same = bool(torch.equal(got, old)) and bool(torch.equal(got_pdl, got))
    fails += not (ok and same)
    line = {"shape": [batch, n, k], "dtype": dtype, "x": how, "ok": ok, "same_bits_as_kept": same}
    result["checks"].append(line)
    print(json.dumps(line), flush=True)
print("check failures", fails, flush=True)

for batch, shapes in [(1, [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]), (4, [(4096, 4096), (14336, 4096)]), (8, [(4096, 4096), (14336, 4096)])]:
    for n, k in shapes:
        def make(n=n, k=k, batch=batch):
            x, w = task.get_inputs(batch=batch, n=n, k=k)
            return x.cuda(), w.cuda()
        sets = rotating_sets(make, n * k // 256 * 144)
        timed = [
            ("kept_pdl", lambda x, w: kept.q4k_gemv(x, w, constant_weight=True)),
            ("new_pdl", lambda x, w: new.q4k_gemv(x, w, constant_weight=True)),
        ]
        if batch == 1:
            timed += [("kept", lambda x, w: kept.q4k_gemv(x, w)), ("new", lambda x, w: new.q4k_gemv(x, w))]
        per = {name: [] for name, _ in timed}
        for r in range(rounds):
            for name, fn in timed[r % len(timed):] + timed[: r % len(timed)]:
                per[name].append(time_rotating(fn, sets, replays=30)[0] * 1e6)
        line = {"batch": batch, "shape": [n, k]}
        for name, _ in timed:
            med = statistics.median(per[name])
            line[name] = {"us": round(med, 3), "tb_s": round(n * k // 256 * 144 / med / 1e6, 3), "rounds": [round(v, 3) for v in per[name]]}
        result["timings"].append(line)
        print(json.dumps({key: (v["us"] if isinstance(v, dict) else v) for key, v in line.items()}), flush=True)
        del sets
        torch.cuda.empty_cache()
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "ab_mma8.json").write_text(json.dumps(result, indent=1))
sys.exit(1 if fails else 0)
