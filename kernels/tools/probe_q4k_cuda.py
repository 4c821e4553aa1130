#!/usr/bin/env python3
"""Check and time the CUDA batch-1 Q4_K GEMV of kernels/q4k_gemv (q4k_gemv.py) on a GPU.

    python kernels/tools/probe_q4k_cuda.py [--out DIR] [--replays 30]

First every case below is checked against a float64 product of the gguf-exact dequantization
(the task's own `check`): Llama shapes, odd row counts, short K, fp16 and bf16, and x scaled by
64 and 1e-3, heavy-tailed, or with whole sub-blocks of zeros. Then the CUDA kernel and the
Triton kernel are timed on the Llama-3-8B shapes the way kernels/tools/sweep_q4k.py times them: L2-cold
rotating weights, one CUDA graph, median and P10/P90 over replays. The CUDA kernel is timed
twice: plain launches ("cuda"), and as programmatic dependent launches ("cuda_pdl", the model
program's way: each call streams its weight while the one before it finishes). With
`--against OLD/q4k_gemv.py[,OTHER/q4k_gemv.py]` (another checkout's, or an older single-file
candidate.py), those files' CUDA kernels are checked and timed in the same run ("OLD_cuda",
"OLD_cuda_pdl"), and `--rounds N` interleaves them: A/B on one machine state. `--batch N` times
batch N instead (the Triton kernel, the batch-1 CUDA kernel launched once per row, the batched
CUDA kernel, and what q4k_gemv picks; with `--against`, those files' batched kernels too).
`--variants` adds other ring depths, CTAs per SM or cluster sizes of the kernel, plain and PDL;
`--candidate OTHER/q4k_gemv.py` puts another checkout's in its place. Writes probe_q4k_cuda.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_q4k import REPO, load, rotating_sets, time_rotating  # noqa: E402

TIMED = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]
CHECKED = [
    (4096, 4096, "bfloat16", "plain"),
    (14336, 4096, "bfloat16", "plain"),
    (4096, 14336, "bfloat16", "plain"),
    (1024, 4096, "float16", "plain"),
    (100, 768, "bfloat16", "plain"),
    (9, 1280, "float16", "plain"),
    (256, 512, "bfloat16", "times64"),
    (4096, 4096, "bfloat16", "times1e-3"),
    (4096, 4096, "bfloat16", "heavy_tails"),
    (4096, 4096, "float16", "heavy_tails"),
    (300, 2048, "bfloat16", "zero_subblocks"),
]


def parse_variant(spec: str) -> tuple[int, int, int, int]:
    """`stages:ctas_per_sm[:min_ctas[:cluster]]` -> the four numbers; fields left out take
    their defaults by position (min_ctas 2, no cluster)."""
    fields = spec.split(":")
    if not 2 <= len(fields) <= 4 or not all(field.isdigit() for field in fields):
        raise ValueError(f"a variant is stages:ctas_per_sm[:min_ctas[:cluster]], not {spec!r}")
    stages, per_sm, min_ctas, cluster = (int(v) for v in fields + ["0", "0", "2", "0"][len(fields) :])
    return stages, per_sm, min_ctas, cluster


def stressed(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "times64":
        return x * 64
    if how == "times1e-3":
        return x * 1e-3
    if how == "heavy_tails":  # log-normal magnitudes over eight orders
        return (x.float() * torch.exp(2.0 * torch.randn_like(x.float()))).to(x.dtype)
    if how == "zero_subblocks":
        x = x.clone()
        x.view(x.shape[0], -1, 32)[:, ::3] = 0
        return x
    return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds per shape")
    parser.add_argument(
        "--variants",
        default="",
        help="extra configurations of the candidate to time, as stages:ctas_per_sm[:min_ctas[:cluster]], "
        "e.g. 2:0,4:0:2,0:0:2:2 (stages 0: by shape; ctas 0: as many as fit; cluster: CTAs per "
        "cluster, where the candidate takes one)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="time batch N (2-8) instead: the Triton kernel, N launches of the batch-1 CUDA kernel "
        "(one per row of x, the first plain or PDL), the batched CUDA kernel (plain and PDL, where it "
        "fits), and q4k_gemv's pick, each checked first",
    )
    parser.add_argument(
        "--candidate",
        type=Path,
        default=REPO / "kernels/q4k_gemv/q4k_gemv.py",
        help="the q4k_gemv.py whose kernels are checked, timed and varied (default: this checkout's)",
    )
    parser.add_argument(
        "--against",
        default="",
        help="other q4k_gemv.py files (comma-separated; say, the last commit's) whose CUDA kernels "
        "are checked and timed beside this one's, in the same run; each is named by its folder",
    )
    parser.add_argument(
        "--k-parts",
        default="",
        help="at --batch N > 1: the batched kernel also with K cut into these numbers of parts "
        "(comma-separated, e.g. 1,2,7), beside its own cut; by default 1 where it cuts K",
    )
    args = parser.parse_args()
    task = load(REPO / "kernels/q4k_gemv/task.py", "cuda_probe_task")
    base = load(REPO / "kernels/q4k_gemv/baseline.py", "cuda_probe_base")
    cand = load(args.candidate.resolve(), "cuda_probe_cand")
    policy = load(args.candidate.resolve().with_name("q4k_gemv_policy.py"), "cuda_probe_policy")
    kernel = cand.cuda_gemv_b1(torch.device("cuda"))
    if kernel is None:
        print("the CUDA kernel did not load", file=sys.stderr)
        return 1
    variants = {}
    for spec in filter(None, args.variants.split(",")):
        stages, per_sm, min_ctas, cluster = parse_variant(spec)
        # a cluster size only where one is asked for: older candidates lack the setting
        extra = {"cluster": cluster} if cluster else {}
        variants[f"cuda_s{stages}_c{per_sm}_m{min_ctas}" + (f"_x{cluster}" if cluster else "")] = cand.CudaGemvB1(
            torch.device("cuda"), stages, per_sm, min_ctas, **extra
        )
    others = {}
    against = [Path(p).resolve() for p in filter(None, args.against.split(","))]
    for index, path in enumerate(against):
        other = load(path, f"cuda_probe_against_{index}")
        if other.cuda_gemv_b1(torch.device("cuda")) is None:
            print(f"the CUDA kernel of {path} did not load", file=sys.stderr)
            return 1
        others[path.parent.name] = other
    result: dict = {"device": torch.cuda.get_device_name(), "checks": [], "timings": []}
    if others:
        result["against"] = [str(path) for path in against]
    failures = 0
    torch.manual_seed(0)
    for n, k, dtype, how in CHECKED:
        x, w = task.get_inputs(batch=1, n=n, k=k, dtype=dtype)
        x, w = stressed(x, how).cuda(), w.cuda()
        want = (x.double() @ base.dequantize_q4_k(w).double().T).to(x.dtype)
        got = cand.q4k_gemv(x, w)
        torch.cuda.synchronize()
        ok = bool(task.check(got, want))
        for other in others.values():  # the others must pass too, or their times mean nothing
            ok = ok and bool(task.check(other.q4k_gemv(x, w), want))
        diff = (got.double() - want.double()).abs()
        rms = want.double().pow(2).mean().sqrt().item()
        line = {
            "shape": [1, n, k],
            "dtype": dtype,
            "x": how,
            "ok": ok,
            "max_abs_diff": diff.max().item(),
            "max_diff_over_rms": diff.max().item() / max(rms, 1e-300),
        }
        failures += not ok
        result["checks"].append(line)
        print(json.dumps(line), flush=True)
    for n, k in TIMED:

        def make(n=n, k=k):
            x, w = task.get_inputs(batch=args.batch, n=n, k=k)
            return x.cuda(), w.cuda()

        sets = rotating_sets(make, n * k // 256 * 144)
        line = {"shape": [args.batch, n, k], "sets": len(sets)}
        if args.batch > 1:
            k_parts = [int(p) for p in filter(None, args.k_parts.split(","))]
            timed = batched_entries(cand, kernel, n, k, args.batch, policy.whole_parts, others, k_parts)
            x0, w0 = sets[0]
            want = (x0.double() @ base.dequantize_q4_k(w0).double().T).to(x0.dtype)
            for name, fn in timed:
                line[f"{name}_ok"] = bool(task.check(fn(x0, w0), want))
                failures += not line[f"{name}_ok"]
        else:
            timed = batch1_entries(cand, others, variants, n, k)
        # Rounds interleave the variants (in a rotated order each round): back-to-back timings
        # of one build drift by several per cent on this machine, so a single pass per variant
        # cannot tell 3 % apart. Reported: the median over rounds of each round's median, the
        # rounds' medians themselves, and the first round's P10/P90 over replays.
        per_round: dict[str, list[tuple[float, float, float]]] = {name: [] for name, _ in timed}
        for r in range(args.rounds):
            for name, fn in timed[r % len(timed):] + timed[: r % len(timed)]:
                per_round[name].append(time_rotating(fn, sets, replays=args.replays))
        for name, fn in timed:
            med = statistics.median(m for m, _, _ in per_round[name])
            _, p10, p90 = per_round[name][0]
            line[name] = {
                "us": round(med * 1e6, 3),
                "p10_us": round(p10 * 1e6, 3),
                "p90_us": round(p90 * 1e6, 3),
                "tb_s": round(task.bytes_moved(batch=args.batch, n=n, k=k) / med / 1e12, 3),
            }
            if args.rounds > 1:
                line[name]["rounds_us"] = [round(m * 1e6, 3) for m, _, _ in per_round[name]]
            # Builds that differ in ring slots or CTAs per SM sum in the same order: same bits.
            if name.removesuffix("_pdl") in variants:
                x0, w0 = sets[0]
                line[name]["same_as_cuda"] = bool(torch.equal(fn(x0, w0), cand.q4k_gemv(x0, w0)))
        result["timings"].append(line)
        print(json.dumps(line), flush=True)
        del sets
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_q4k_cuda.json").write_text(json.dumps(result, indent=1))
    print(summary(result), flush=True)
    return 1 if failures else 0


def batch1_entries(cand, others: dict, variants: dict, n: int, k: int) -> list:
    """At batch 1: the candidate's CUDA kernel plain and as a programmatic dependent, its Triton
    kernel, each `--against` file's CUDA kernel both ways, and each variant both ways."""
    config = cand.pick_config(n, k // 256, 1)
    timed = [
        ("cuda", lambda x, w: cand.q4k_gemv(x, w)),
        # the rotating weights are never written: launched as a programmatic dependent, each
        # call streams its weight while the call before it finishes
        ("cuda_pdl", lambda x, w: cand.q4k_gemv(x, w, constant_weight=True)),
        ("triton", lambda x, w: cand.q4k_gemv(x, w, config)),
    ]
    for label, other in others.items():
        timed += [
            (f"{label}_cuda", lambda x, w, other=other: other.q4k_gemv(x, w)),
            (f"{label}_cuda_pdl", lambda x, w, other=other: other.q4k_gemv(x, w, constant_weight=True)),
        ]
    for name, variant in variants.items():
        for suffix, dependent in (("", False), ("_pdl", True)):

            def run(x, w, variant=variant, dependent=dependent):
                out = torch.empty((1, n), dtype=x.dtype, device=x.device)
                variant(x, w, out, dependent=dependent)
                return out

            timed.append((name + suffix, run))
    return timed


def batched_entries(
    cand,
    kernel,
    n: int,
    k: int,
    batch: int,
    whole_parts,
    others: dict | None = None,
    k_parts: list[int] | None = None,
) -> list:
    """At batch > 1: the Triton kernel, the batch-1 CUDA kernel launched once per row of x into
    its row of y (which reads the weight once per row; the first row plain or as a dependent,
    the others always dependents), the batched CUDA kernel where it fits (and with two ring
    slots where only that fits two CTAs per SM, and over the whole of K where it cuts K into
    parts), what the task's `q4k_gemv` picks (`cuda_path`), and each `--against` file's
    batched kernel both ways. `whole_parts`: the policy's, for the cuts of K asked for."""

    def rows(x, w, dependent=False):
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
        kernel(x, w, out, dependent=dependent)
        return out

    def triton(x, w):  # a config given keeps q4k_gemv on its Triton kernel
        return cand.q4k_gemv(x, w, config=cand.pick_config(n, k // 256, x.shape[0]))

    def batched(x, w, dependent=False, **ring):  # one launch for every row of x, where it fits
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
        kernel.batched(x, w, out, dependent=dependent, **ring)
        return out

    entries = [
        ("triton", triton),
        ("q4k_gemv", lambda x, w: cand.q4k_gemv(x, w, constant_weight=True)),
        ("cuda_rows", rows),
        ("cuda_rows_pdl", lambda x, w: rows(x, w, dependent=True)),
    ]
    if hasattr(kernel, "batched") and kernel.batched_fits(k // 256, batch, n):
        entries += [("cuda_batched", batched), ("cuda_batched_pdl", lambda x, w: batched(x, w, dependent=True))]
    # K cut into other numbers of parts (by default: over the whole of K, where the kernel's
    # own cut is more than one part), each where it fits
    if hasattr(kernel, "batched_k_parts"):
        own = kernel.batched_k_parts(k // 256, batch, n)
        wanted = {whole_parts(k // 256, parts) for parts in k_parts or ([1] if own > 1 else [])}
        for parts in sorted(wanted - {own}):
            if not kernel.batched_fits(k // 256, batch, n, k_parts=parts):
                continue
            entries += [
                (f"cuda_batched_k{parts}", lambda x, w, p=parts: batched(x, w, k_parts=p)),
                (f"cuda_batched_k{parts}_pdl", lambda x, w, p=parts: batched(x, w, dependent=True, k_parts=p)),
            ]
    for label, other in (others or {}).items():
        other_kernel = other.cuda_gemv_b1(torch.device("cuda"))
        # (files from before the batched kernel took the row count: batched_fits(n_blocks, batch))
        takes_rows = "n_rows" in inspect.signature(getattr(other_kernel, "batched_fits", print)).parameters
        fits_args = (k // 256, batch, n) if takes_rows else (k // 256, batch)
        if hasattr(other_kernel, "batched") and other_kernel.batched_fits(*fits_args):

            def other_batched(x, w, dependent=False, other_kernel=other_kernel):
                out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
                other_kernel.batched(x, w, out, dependent=dependent)
                return out

            entries += [
                (f"{label}_cuda_batched", other_batched),
                (f"{label}_cuda_batched_pdl", lambda x, w, f=other_batched: f(x, w, dependent=True)),
            ]
    # two ring slots where that lets a second CTA onto each SM (K = 14336, batches 2-3)
    if (
        hasattr(kernel, "batched_ctas_per_sm")
        and kernel.batched_ctas_per_sm(k // 256, batch, n, 2) > kernel.batched_ctas_per_sm(k // 256, batch, n)
    ):
        entries += [
            ("cuda_batched_s2", lambda x, w: batched(x, w, stages=2)),
            ("cuda_batched_s2_pdl", lambda x, w: batched(x, w, dependent=True, stages=2)),
        ]
    return entries


def summary(result: dict) -> str:
    """The timings as one short table (µs, TB/s; [min, max] over rounds where there were
    several), and how many checks passed: what a reader of the device's output wants."""
    checks = result.get("checks", [])
    lines = [f"checks: {sum(c['ok'] for c in checks)} of {len(checks)} passed"]
    for line in result.get("timings", []):
        _, n, k = line["shape"]
        cells = []
        for name, timing in line.items():
            if not isinstance(timing, dict) or "us" not in timing:
                continue
            rounds = timing.get("rounds_us")
            spread = f" [{min(rounds):.2f}, {max(rounds):.2f}]" if rounds else ""
            cells.append(f"{name} {timing['us']:.2f}{spread} ({timing['tb_s']:.2f})")
        lines.append(f"{n}x{k}: " + "; ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
