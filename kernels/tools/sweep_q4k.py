#!/usr/bin/env python3
"""Sweep the Q4_K kernels' tile configurations on a GPU and print effective bandwidth.

    python kernels/tools/sweep_q4k.py [--out DIR] [--only gemv,gemm,rmsnorm,floor]

Each configuration runs on rotating weight copies whose total exceeds 3x the L2 cache, inside
one CUDA graph (so launch gaps and L2 hits do not flatter it); the figure is the median over
replays of (graph time / calls). The configuration each kernel's `pick_config` should choose
is read off this table; the judge's own benchmark then confirms it through the loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def load(path: Path, name: str):
    """Import a file as module `name`, its directory first on sys.path while it loads, as the
    judge's jobs import a candidate: it finds its sibling modules (a kernel directory's library)
    by their own names. Those siblings are its directory's: a module of the same name that a
    file of another directory loaded before (another checkout, for A/B) is set aside meanwhile."""
    directory = path.resolve().parent
    siblings = {p.stem for p in directory.glob("*.py")}
    aside = {
        key: sys.modules.pop(key)
        for key in list(sys.modules)
        if key in siblings and Path(getattr(sys.modules[key], "__file__", None) or "/").parent != directory
    }
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(directory))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(directory))
        for key in aside:  # this directory's siblings stay with the module that imported them
            sys.modules.pop(key, None)
        sys.modules.update(aside)
    return module


def time_rotating(fn, sets: list[tuple], replays: int = 20) -> tuple[float, float, float]:
    """(median, p10, p90) seconds per call over graph replays of one call per input set."""
    for args in sets[:2]:
        fn(*args)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in sets[:2]:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in sets:
            fn(*args)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(sets))
    times.sort()
    return statistics.median(times), times[len(times) // 10], times[-1 - len(times) // 10]


def table_row(kernel: str, shape: list[int], config, timing=None, error=None, **fields) -> dict:
    """One row of the sweep: a configuration, its (median, p10, p90) seconds per call and derived
    figures, or why it failed (a configuration that does not compile is a row, not a crash)."""
    row = {
        "kernel": kernel,
        "shape": shape,
        "config": config if isinstance(config, str) else config._asdict(),
    }
    if error is not None:
        return row | {"error": repr(error)[:300]}
    med, p10, p90 = timing
    return row | {"us": med * 1e6, "p10_us": p10 * 1e6, "p90_us": p90 * 1e6} | fields


def rotating_sets(make, bytes_each: int) -> list[tuple]:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
    count = max(4, min(64, (3 * l2) // max(bytes_each, 1) + 1))
    return [make() for _ in range(count)]


def sweep_gemv(rows: list[dict]) -> None:
    task = load(REPO / "kernels/q4k_gemv/task.py", "sweep_gemv_task")
    cand = load(REPO / "kernels/q4k_gemv/q4k_gemv.py", "sweep_gemv_cand")
    base = load(REPO / "kernels/q4k_gemv/baseline.py", "sweep_gemv_base")
    shapes = [
        (1, 4096, 4096),
        (1, 1024, 4096),
        (1, 14336, 4096),
        (1, 4096, 14336),
        (8, 14336, 4096),
    ]
    configs = [
        cand.GemvConfig(bn, kb, w, xr)
        for bn, kb, w, xr in itertools.product([2, 4, 8, 16], [8, 16], [1, 2, 4], [False, True])
        if bn * kb * 8 >= 32 * w * 2 and bn * kb <= 128
    ] + [  # the TF32 tensor-core variant
        cand.GemvConfig(bn, kb, w, method="mma")
        for bn, kb, w in [(64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 2, 8), (128, 4, 8), (64, 4, 8)]
    ]
    for batch, n, k in shapes:
        weight_bytes = n * k // 256 * 144

        def make(batch=batch, n=n, k=k):
            x, w = task.get_inputs(batch=batch, n=n, k=k)
            return x.cuda(), w.cuda()

        sets = rotating_sets(make, weight_bytes)
        x0, w0 = sets[0]
        expected = base.ModelNew()(x0, w0).float()
        ideal = task.bytes_moved(batch=batch, n=n, k=k)
        base_t = time_rotating(base.ModelNew(), sets[:4], replays=5)[0]
        best = None
        for config in configs:
            try:
                out = cand.q4k_gemv(x0, w0, config).float()
                err = (out - expected).abs().max().item()
                timing = time_rotating(lambda x, w, c=config: cand.q4k_gemv(x, w, c), sets)
            except Exception as exc:
                rows.append(table_row("q4k_gemv", [batch, n, k], config, error=exc))
                continue
            med = timing[0]
            row = table_row(
                "q4k_gemv",
                [batch, n, k],
                config,
                timing,
                tb_s=ideal / med / 1e12,
                max_err_vs_baseline=err,
                speedup_vs_naive=base_t / med,
            )
            rows.append(row)
            if best is None or med < best["us"] / 1e6:
                best = row
        default = cand.q4k_gemv  # what pick_config chooses
        timing = time_rotating(default, sets)
        med = timing[0]
        print(
            f"gemv b{batch} {n}x{k}: naive {base_t * 1e6:.1f} us; default {med * 1e6:.2f} us "
            f"({ideal / med / 1e12:.2f} TB/s); best {best and best['config']} "
            f"{best and round(best['us'], 2)} us ({best and round(best['tb_s'], 2)} TB/s)",
            flush=True,
        )
        rows.append(
            table_row(
                "q4k_gemv",
                [batch, n, k],
                "default",
                timing,
                tb_s=ideal / med / 1e12,
                naive_us=base_t * 1e6,
            )
        )
        del sets
        torch.cuda.empty_cache()


def read_kernels():
    """Two kernels that only read a Q4_K weight and fold its words into one number: the floor a
    GEMV timed the same way cannot beat. `tiled` walks the weight as q4k_gemv's default tiling
    does at K = 4096 (two rows and 16 blocks per one-warp program, the header word and each
    chunk's 32 bytes as separate loads); `flat` streams 16 KB contiguous per four-warp program."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_tiled(w_ptr, out_ptr, n_rows, n_blocks, w_row_words, BLOCK_N: tl.constexpr,
                   BLOCK_KB: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_words = tl.multiple_of(tl.minimum(rows, n_rows - 1).to(tl.int64) * w_row_words, 4)
        kbs = tl.arange(0, BLOCK_KB)
        words8 = tl.arange(0, 8)
        acc = tl.zeros([BLOCK_N, BLOCK_KB, 8], dtype=tl.int32)
        for kb0 in range(0, n_blocks, BLOCK_KB):
            block_words = row_words[:, None] + tl.minimum(kb0 + kbs, n_blocks - 1)[None, :] * 36
            acc += tl.load(w_ptr + block_words)[:, :, None]
            for c in tl.static_range(4):
                code_words = tl.multiple_of(block_words + 4 + 8 * c, [4, 4])
                acc ^= tl.load(w_ptr + code_words[:, :, None] + words8[None, None, :])
        total = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(out_ptr + rows, total, mask=rows < n_rows)

    @triton.jit
    def read_flat(w_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
        offsets = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(STEPS):
            index = base + i * BLOCK + offsets
            acc ^= tl.load(w_ptr + index, mask=index < n_words, other=0)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc))

    def tiled(weight: torch.Tensor) -> torch.Tensor:
        n_rows, n_blocks = weight.shape[0], weight.shape[1] // 144
        out = torch.empty(n_rows, dtype=torch.int32, device=weight.device)
        grid = (triton.cdiv(n_rows, 2),)
        read_tiled[grid](weight.view(torch.int32), out, n_rows, n_blocks, n_blocks * 36,
                         BLOCK_N=2, BLOCK_KB=min(16, triton.next_power_of_2(n_blocks)), num_warps=1)
        return out

    def flat(weight: torch.Tensor) -> torch.Tensor:
        words = weight.view(torch.int32).reshape(-1)
        grid = (triton.cdiv(words.numel(), 4096),)
        out = torch.empty(grid[0], dtype=torch.int32, device=weight.device)
        read_flat[grid](words, out, words.numel(), BLOCK=1024, STEPS=4, num_warps=4)
        return out

    return {"tiled": tiled, "flat": flat}


def sweep_floor(rows: list[dict]) -> None:
    """The read-only floors at the batch-1 Llama shapes, beside the GEMV's own time."""
    task = load(REPO / "kernels/q4k_gemv/task.py", "floor_gemv_task")
    cand = load(REPO / "kernels/q4k_gemv/q4k_gemv.py", "floor_gemv_cand")
    readers = read_kernels()
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]:

        def make(n=n, k=k):
            x, w = task.get_inputs(batch=1, n=n, k=k)
            return x.cuda(), w.cuda()

        sets = rotating_sets(make, n * k // 256 * 144)
        weight_bytes = task.bytes_moved(batch=1, n=n, k=k)
        timings = {"q4k_gemv": time_rotating(cand.q4k_gemv, sets)}
        for name, reader in readers.items():
            timings[f"read_{name}"] = time_rotating(lambda x, w, reader=reader: reader(w), sets)
        for name, timing in timings.items():
            rows.append(table_row(name, [1, n, k], "default", timing,
                                  tb_s=weight_bytes / timing[0] / 1e12))
        print(f"floor {n}x{k}: " + "; ".join(
            f"{name} {t[0] * 1e6:.2f} us ({weight_bytes / t[0] / 1e12:.2f} TB/s)"
            for name, t in timings.items()), flush=True)
        del sets
        torch.cuda.empty_cache()


def sweep_gemm(rows: list[dict]) -> None:
    task = load(REPO / "kernels/q4k_gemm/task.py", "sweep_gemm_task")
    cand = load(REPO / "kernels/q4k_gemm/q4k_gemm.py", "sweep_gemm_cand")
    base = load(REPO / "kernels/q4k_gemm/baseline.py", "sweep_gemm_base")
    for m in [16, 64, 256, 1024, 2048]:
        for n, k in [(14336, 4096), (4096, 14336)]:

            def make(m=m, n=n, k=k):
                x, w = task.get_inputs(m=m, n=n, k=k)
                return x.cuda(), w.cuda()

            sets = rotating_sets(make, n * k // 256 * 144 + m * k * 2)
            x0, w0 = sets[0]
            dense = cand.dequantize_to(w0, torch.bfloat16)
            flops = 2.0 * m * n * k
            cublas = time_rotating(lambda x, w, dense=dense: x @ dense.T, sets[:4])[0]
            base_t = time_rotating(base.ModelNew(), sets[:4], replays=5)[0]
            expected = x0.float() @ dense.float().T
            for config in cand.sweep_configs(m):
                try:
                    out = cand.q4k_gemm(x0, w0, config).float()
                    err = ((out - expected).abs().max() / expected.abs().max()).item()
                    timing = time_rotating(
                        lambda x, w, c=config: cand.q4k_gemm(x, w, c), sets, replays=10
                    )
                except Exception as exc:
                    rows.append(table_row("q4k_gemm", [m, n, k], config, error=exc))
                    continue
                med = timing[0]
                rows.append(
                    table_row(
                        "q4k_gemm",
                        [m, n, k],
                        config,
                        timing,
                        tflops=flops / med / 1e12,
                        cublas_tflops=flops / cublas / 1e12,
                        naive_us=base_t * 1e6,
                        rel_err=err,
                    )
                )
                print(
                    f"gemm m{m} {n}x{k} {config}: {med * 1e6:.1f} us {flops / med / 1e12:.0f} TFLOP/s "
                    f"(cuBLAS {flops / cublas / 1e12:.0f}, naive {base_t * 1e6:.0f} us) err {err:.1e}",
                    flush=True,
                )
            del sets
            torch.cuda.empty_cache()


def sweep_rmsnorm(rows: list[dict]) -> None:
    task = load(REPO / "kernels/rmsnorm/task.py", "sweep_rms_task")
    lib = load(REPO / "kernels/rmsnorm/rmsnorm.py", "sweep_rms_lib")
    copy = 4.265e12  # measured D2D copy bandwidth on the H200 (docs/measurements.md)
    for tokens, hidden in [(4096, 4096), (1023, 4000), (512, 4096), (512, 5120)]:
        shape = {"tokens": tokens, "hidden": hidden}
        model = task.Model(*task.get_init_inputs(**shape)).cuda()  # for its weight and eps

        def make(shape=shape):
            return tuple(t.cuda() for t in task.get_inputs(**shape))

        sets = rotating_sets(make, tokens * hidden * 2)
        moved = task.bytes_moved(**shape)
        for block_rows, warps in itertools.product([1, 2, 4, 8], [2, 4, 8, 16]):
            config = lib.RmsnormConfig(block_rows, warps)
            try:
                timing = time_rotating(
                    lambda x, c=config, m=model: lib.rmsnorm(x, m.weight, m.eps, c), sets
                )
            except Exception as exc:
                rows.append(table_row("rmsnorm", [tokens, hidden], config, error=exc))
                continue
            med = timing[0]
            rows.append(
                table_row(
                    "rmsnorm",
                    [tokens, hidden],
                    config,
                    timing,
                    tb_s=moved / med / 1e12,
                    pct_copy=100 * moved / med / copy,
                )
            )
        best = min(
            (
                r
                for r in rows
                if r["kernel"] == "rmsnorm" and r["shape"] == [tokens, hidden] and "us" in r
            ),
            key=lambda r: r["us"],
            default=None,
        )
        default = time_rotating(lambda x, m=model: lib.rmsnorm(x, m.weight, m.eps), sets)[0]  # pick_config's
        print(
            f"rmsnorm {tokens}x{hidden}: default {default * 1e6:.2f} us ({100 * moved / default / copy:.1f} % copy); "
            f"best {best and best['config']} {best and round(best['pct_copy'], 1)} % copy",
            flush=True,
        )
        del sets
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--only", default="gemv,gemm,rmsnorm")
    args = parser.parse_args()
    rows: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if "gemv" in args.only:
            sweep_gemv(rows)
        if "gemm" in args.only:
            sweep_gemm(rows)
        if "rmsnorm" in args.only:
            sweep_rmsnorm(rows)
        if "floor" in args.only:
            sweep_floor(rows)
    finally:
        (args.out / "sweep_q4k.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
