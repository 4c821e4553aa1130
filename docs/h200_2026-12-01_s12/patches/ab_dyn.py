"""A/B on the GPU: the kept batch-1 kernel against the dynamic-unit kernel (exp/dyn)."""
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
kept = load(REPO / "kernels/q4k_gemv/candidate.py", "kept")
dyn = load(REPO / "exp/dyn/candidate.py", "dyn")
kd = dyn.cuda_gemv_b1(torch.device("cuda"))
result = {"device": torch.cuda.get_device_name(), "checks": [], "timings": []}


def dyn_call(uc, dependent):
    def run(x, w):
        out = torch.empty((1, w.shape[0]), dtype=x.dtype, device=x.device)
        kd.dynamic(x, w, out, dependent=dependent, unit_chunks=uc)
        return out
    return run


torch.manual_seed(0)
fails = 0
for n, k, ucs in [(4096, 4096, [2, 1]), (14336, 4096, [2, 1]), (4096, 14336, [7, 4, 2, 1]), (1024, 4096, [2, 1]),
                  (100, 768, [1]), (9, 1280, [1]), (300, 2048, [1]), (4100, 14336, [3])]:
    for dtype in ("bfloat16", "float16"):
        x, w = task.get_inputs(batch=1, n=n, k=k, dtype=dtype)
        x, w = x.cuda(), w.cuda()
        want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
        for uc in ucs:
            first = dyn_call(uc, False)(x, w)
            same = True
            for rep in range(6):  # counters left zero by each launch: repeats give the same bits
                again = dyn_call(uc, rep % 2 == 1)(x, w)
                same = same and torch.equal(again, first)
            torch.cuda.synchronize()
            ok = bool(task.check(first, want)) and same
            fails += not ok
            line = {"shape": [n, k], "dtype": dtype, "unit_chunks": uc, "ok": ok, "repeat_same": same,
                    "max_abs_diff": (first.double() - want.double()).abs().max().item()}
            result["checks"].append(line)
            print(json.dumps(line), flush=True)
print("check failures", fails, flush=True)

for n, k, ucs in [(4096, 4096, [2, 1]), (14336, 4096, [2, 1]), (4096, 14336, [7, 4, 2, 1])]:
    def make(n=n, k=k):
        x, w = task.get_inputs(batch=1, n=n, k=k)
        return x.cuda(), w.cuda()
    sets = rotating_sets(make, n * k // 256 * 144)
    x_hot = sets[0][0]
    timed = [
        ("kept", lambda x, w: kept.q4k_gemv(x, w)),
        ("kept_pdl", lambda x, w: kept.q4k_gemv(x, w, constant_weight=True)),
        ("kept_pdl_xhot", lambda x, w, x_hot=x_hot: kept.q4k_gemv(x_hot, w, constant_weight=True)),
    ]
    for uc in ucs:
        timed.append((f"dyn{uc}_pdl", dyn_call(uc, True)))
    timed.append((f"dyn{ucs[-1]}", dyn_call(ucs[-1], False)))
    hot = dyn_call(ucs[-1], True)
    timed.append((f"dyn{ucs[-1]}_pdl_xhot", lambda x, w, f=hot, x_hot=x_hot: f(x_hot, w)))
    per = {name: [] for name, _ in timed}
    for r in range(rounds):
        for name, fn in timed[r % len(timed):] + timed[: r % len(timed)]:
            per[name].append(time_rotating(fn, sets, replays=30)[0] * 1e6)
    line = {"shape": [n, k]}
    for name, _ in timed:
        med = statistics.median(per[name])
        line[name] = {"us": round(med, 3), "tb_s": round(n * k // 256 * 144 / med / 1e6, 3),
                      "rounds": [round(v, 3) for v in per[name]]}
    result["timings"].append(line)
    print(json.dumps({"shape": [n, k], **{name: v["us"] for name, v in line.items() if name != "shape"}}), flush=True)
    del sets
    torch.cuda.empty_cache()
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / "ab_dyn.json").write_text(json.dumps(result, indent=1))
sys.exit(1 if fails else 0)
