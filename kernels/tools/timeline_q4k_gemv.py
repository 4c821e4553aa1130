"""Where the CUDA Q4_K GEMV's time goes, CTA by CTA: a timeline from the GPU's global timer.

    python kernels/tools/timeline_q4k_gemv.py [--out DIR] [--shapes 14336x4096,4096x14336] [--replays 5]

The GEMV's CUDA source (kernels/q4k_gemv/q4k_gemv.cu) is instrumented by text insertion at fixed anchors (the tool stops
if one is missing) and built under its own name. Each CTA records, in nanoseconds of
%globaltimer: its start, when its consumers may read x (griddepcontrol.wait returns), when x is
prepared, when the producer issues each chunk, when consumer warp 0 sees each chunk arrive,
when every consumer warp is done with each chunk, and its end. Timed as the probe times the
GEMV: one CUDA graph of launches over rotating L2-cold weights, each launch either plain or a
programmatic dependent of the one before ("pdl": how the probe's cuda_pdl and the model run).

Variants, each built and recorded in the same run:
- `kept`: the kernel as it is;
- `no_math`: the consumers release each chunk without any arithmetic (the tenth session's
  diagnostic): what the stream alone costs in the same structure.

Prints, per variant, shape and launch mode, medians over the middle launches of each replay:
the launch's length (its last CTA end after the previous launch's), when the first and last
CTA start, when the last chunk arrives, and the tail after it (last CTA end - last arrival);
per CTA the median arrival gap between chunks and the time its consumers spend after their
last chunk arrives; how many SMs the launch's CTAs cover, and when the CTAs end that started
late (as the launch before ended) or early, and that had an SM to themselves or shared it.
Writes timeline.json (the summaries) and timeline.npz (every record).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_q4k import REPO, load, rotating_sets  # noqa: E402

MAX_ITEMS = 16  # (tile, chunk) pairs recorded per CTA
# record layout, u64 each: 0 sm id << 32 | block, 1 start, 2 x readable, 3 x prepared, 4 end,
# then issue[MAX_ITEMS], arrive[MAX_ITEMS] (warp 0), done[8 warps][MAX_ITEMS]
ISSUE, ARRIVE, DONE = 5, 5 + MAX_ITEMS, 5 + 2 * MAX_ITEMS
RECORD = DONE + 8 * MAX_ITEMS

DECLARATIONS = r"""
__device__ unsigned long long* g_timeline;
__device__ int g_timeline_seen[9 * 4096];  // per (CTA, warp): launches so far
__device__ unsigned long long* g_timeline_producer[4096];  // per CTA: its record, for produce()
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
"""

HOST = r"""
void q4k_timeline_reset(void* buffer) {
  cudaMemcpyToSymbol(g_timeline, &buffer, sizeof(buffer));
  void* seen = nullptr;
  cudaGetSymbolAddress(&seen, g_timeline_seen);
  cudaMemset(seen, 0, sizeof(int) * 9 * 4096);
}
"""

BINDING = r"""
void q4k_timeline_reset(void* buffer);
void timeline_reset(int64_t address) { q4k_timeline_reset(reinterpret_cast<void*>(address)); }
"""

# (anchor, text inserted after it); the anchor must occur exactly once
INSERTIONS = [
    (
        "const int g = lane >> 2, t = lane & 3;\n",
        f"""  const unsigned long long t_start = now_ns();
  // the launch's index in the graph, counted per warp: no shared memory or barrier added
  int seen = 0;
  if (lane == 0) seen = atomicAdd(&g_timeline_seen[blockIdx.x * 9 + warp], 1);
  seen = __shfl_sync(0xFFFFFFFFu, seen, 0);
  unsigned long long* rec = g_timeline + ((long long)seen * gridDim.x + blockIdx.x) * {RECORD};
  if (tid == 0) {{
    unsigned int sm;
    asm("mov.u32 %0, %smid;" : "=r"(sm));
    rec[0] = ((unsigned long long)sm << 32) | blockIdx.x;
    rec[1] = t_start;
  }}
  if (warp == WARPS && lane == 0) g_timeline_producer[blockIdx.x] = rec;  // for produce()
""",
    ),
    (
        'asm volatile("griddepcontrol.wait;" ::: "memory");\n',
        "  if (tid == 0) rec[2] = now_ns();\n",
    ),
    (
        "      bar_wait(full + 8 * slot, round & 1);\n",
        f"      const int item = tile_iter * n_chunks + chunk;\n"
        f"      if (tid == 0 && item < {MAX_ITEMS}) rec[{ARRIVE} + item] = now_ns();\n",
    ),
]


def insert(text: str, anchor: str, addition: str, before: str = "") -> str:
    """`addition` placed right after `anchor`, or where `before` (the anchor's tail) begins;
    the anchor must occur exactly once: a kernel change that moves one stops the tool."""
    if text.count(anchor) != 1:
        raise SystemExit(f"anchor found {text.count(anchor)} times, not once: {anchor!r}")
    at = text.index(anchor) + len(anchor) - len(before)
    return text[:at] + addition + text[at:]


def instrument(source: str, no_math: bool) -> str:
    # only the batch-1 kernel is instrumented: cut it out, edit it, put it back
    begin = source.index("q4k_gemv_b1_kernel(const")
    end = source.index("\n}\n", begin) + 3
    head, out, tail = source[:begin], source[begin:end], source[end:]
    head = insert(head, "typedef unsigned short u16;\n", DECLARATIONS)
    # the producer's issues, in the ring's shared producer function (the batched kernel calls
    # it too, but is never launched here)
    head = insert(
        head,
        "    if (round > 0) bar_wait(empty + 8 * slot, (round - 1) & 1);\n",
        f"    if (lane == 0 && i < {MAX_ITEMS}) g_timeline_producer[blockIdx.x][{ISSUE} + i] = now_ns();\n",
    )
    for anchor, addition in INSERTIONS:
        out = insert(out, anchor, addition)
    # x prepared: after the warp's x loop, before the main loop's comment
    tail_of_x = "\n  // Lane (g, t)"
    out = insert(out, "  __syncwarp();\n" + tail_of_x, "  if (tid == 0) rec[3] = now_ns();\n", before=tail_of_x)
    # each warp done with a chunk: just before the ring position moves on
    moves_on = "      next_slot(slot, round, stages);\n    }\n\n    // This tile's rows"
    done = f"      if (lane == 0 && item < {MAX_ITEMS}) rec[{DONE} + warp * {MAX_ITEMS} + item] = now_ns();\n"
    out = insert(out, moves_on, done, before=moves_on)
    # the CTA's end: after the last tile's rows are written (thread 0 writes one of them)
    out = insert(out, "      y[row] = from_float(total, x_is_bf16);\n    }\n  }\n", "  if (tid == 0) rec[4] = now_ns();\n")
    if no_math:  # the consumers release each chunk untouched
        taken = "      if (FullChunks || b < n_blocks) {\n        const u32 block = ring"
        out = insert(out, taken, "", before=taken).replace(taken, taken.replace("FullChunks || b < n_blocks", "false"))
    return head + out + tail + HOST


def build(cuda, no_math: bool):
    """A CudaGemvB1 of the instrumented source, with `timeline_reset` bound beside `launch`."""
    import torch.utils.cpp_extension as cpp

    original_load = cpp.load_inline

    def load_inline(**kwargs):
        kwargs["functions"] = [*kwargs["functions"], "timeline_reset"]
        kwargs["name"] = kwargs["name"] + ("_tl_nomath" if no_math else "_tl")
        return original_load(**kwargs)

    cpp.load_inline = load_inline
    try:
        source = instrument(cuda.cuda_source(), no_math)
        return cuda.CudaGemvB1(torch.device("cuda"), source=source, binding=cuda.CUDA_BINDING + BINDING)
    finally:
        cpp.load_inline = original_load


def record_chain(kernel, sets: list, pdl: bool, replays: int) -> np.ndarray:
    """[replays, launches, grid, RECORD] of one graph of len(sets) launches, each replay L2-cold
    for its weights (the sets rotate through more bytes than L2 holds)."""
    n_rows, n_blocks = sets[0][1].shape[0], sets[0][1].shape[1] // 144
    grid = kernel.grid(n_rows, n_blocks)
    outs = [torch.empty(1, n_rows, dtype=x.dtype, device="cuda") for x, _ in sets]
    buffer = torch.zeros(len(sets) * grid * RECORD, dtype=torch.int64, device="cuda")

    def chain():
        for i, (x, w) in enumerate(sets):
            kernel(x, w, outs[i], dependent=pdl and i > 0)

    kernel.module.timeline_reset(buffer.data_ptr())
    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    records = []
    for _ in range(replays + 1):
        kernel.module.timeline_reset(buffer.data_ptr())
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        records.append(buffer.view(len(sets), grid, RECORD).cpu().numpy().copy())
    return np.stack(records[1:])


def summarize(records: np.ndarray, n_items: int) -> dict:
    """Medians over replays and the middle launches (not the first or last of the graph).
    Times are from the previous launch's last CTA end; a CTA with fewer items than others
    leaves zeros in its later entries, which are masked."""
    replays, launches, grid, _ = records.shape
    items = min(n_items, MAX_ITEMS)
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(float(value))

    for r in range(replays):
        for j in range(1, launches - 1):
            rec, prev = records[r, j].astype(np.float64), records[r, j - 1].astype(np.float64)
            t0 = prev[:, 4].max()
            arrive = np.where(rec[:, ARRIVE : ARRIVE + items] > 0, rec[:, ARRIVE : ARRIVE + items], np.nan)
            issue = np.where(rec[:, ISSUE : ISSUE + items] > 0, rec[:, ISSUE : ISSUE + items], np.nan)
            done = rec[:, DONE : DONE + 8 * MAX_ITEMS].reshape(grid, 8, MAX_ITEMS)[:, :, :items].max(axis=1)
            done = np.where(np.isnan(arrive), np.nan, done)
            last_arrival = np.nanmax(arrive, axis=1)
            add("launch_us", (rec[:, 4].max() - t0) / 1e3)
            add("first_start_us", (rec[:, 1].min() - t0) / 1e3)
            add("last_start_us", (rec[:, 1].max() - t0) / 1e3)
            add("x_readable_median_us", (np.median(rec[:, 2]) - t0) / 1e3)
            add("x_prepared_median_us", (np.median(rec[:, 3]) - t0) / 1e3)
            add("first_arrival_median_us", (np.median(arrive[:, 0]) - t0) / 1e3)
            add("last_arrival_us", (last_arrival.max() - t0) / 1e3)
            add("last_done_us", (np.nanmax(done) - t0) / 1e3)
            add("tail_us", (rec[:, 4].max() - last_arrival.max()) / 1e3)
            add("cta_after_last_arrival_median_us", np.median(rec[:, 4] - last_arrival) / 1e3)
            add("cta_start_to_first_arrival_median_us", np.median(arrive[:, 0] - rec[:, 1]) / 1e3)
            add("first_issue_to_arrival_median_us", np.nanmedian(arrive[:, 0] - issue[:, 0]) / 1e3)
            if items > 1:
                add("arrival_gap_median_us", np.nanmedian(np.diff(arrive, axis=1)) / 1e3)
            # from a chunk's arrival (seen by warp 0) to the last warp done with it
            add("done_after_arrival_median_us", np.nanmedian(done - arrive) / 1e3)
            add("done_after_arrival_p90_us", np.nanquantile(done - arrive, 0.9) / 1e3)
            # Who ends last. Under PDL a CTA starts as one of the launch before leaves its slot:
            # the late starters (within 0.5 us of that launch's end, or after) stream their whole
            # share once everyone else has a ring full. And the grid rarely covers every SM evenly:
            # a CTA with its SM to itself (of this launch's CTAs) gets the SM's issue slots alone.
            end = (rec[:, 4] - t0) / 1e3
            late = rec[:, 1] - t0 >= -500
            sm = records[r, j, :, 0].astype(np.int64) >> 32
            _, which, per_sm = np.unique(sm, return_inverse=True, return_counts=True)
            alone = per_sm[which] == 1
            add("sms_used", len(per_sm))
            add("late_start_ctas", int(late.sum()))
            add("alone_on_sm_ctas", int(alone.sum()))
            for key, mask in (("late_start", late), ("early_start", ~late), ("alone_on_sm", alone), ("shared_sm", ~alone)):
                if mask.any():
                    add(f"{key}_end_median_us", np.median(end[mask]))
    summary = {key: round(statistics.median(values), 3) for key, values in rows.items()}
    # CTA starts and ends as quantiles, in the middle launch of the first replay
    rec, prev = records[0, launches // 2], records[0, launches // 2 - 1]
    t0 = prev[:, 4].max()
    for key, column in (("cta_start_quantiles_us", 1), ("cta_end_quantiles_us", 4)):
        times = (rec[:, column] - t0) / 1e3
        summary[key] = [round(float(np.quantile(times, q)), 3) for q in (0, 0.1, 0.5, 0.9, 1)]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--shapes", default="14336x4096,4096x14336,4096x4096")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument(
        "--candidate",
        type=Path,
        default=REPO / "kernels/q4k_gemv/q4k_gemv_cuda.py",
        help="the q4k_gemv_cuda.py whose CUDA source is instrumented (default: this checkout's)",
    )
    args = parser.parse_args()
    task = load(REPO / "kernels/q4k_gemv/task.py", "timeline_task")
    cuda = load(args.candidate.resolve(), "timeline_cuda")
    variants = {"kept": build(cuda, False), "no_math": build(cuda, True)}
    result: dict = {"device": torch.cuda.get_device_name(), "summaries": []}
    arrays: dict[str, np.ndarray] = {}
    torch.manual_seed(0)
    for spec in args.shapes.split(","):
        n, k = (int(v) for v in spec.split("x"))

        def make(n=n, k=k):
            x, w = task.get_inputs(batch=1, n=n, k=k)
            return x.cuda(), w.cuda()

        sets = rotating_sets(make, n * k // 256 * 144)
        n_blocks = k // 256
        for name, kernel in variants.items():
            grid = kernel.grid(n, n_blocks)
            n_items = (-(-n // 16) + grid - 1) // grid * (-(-n_blocks // 8))
            for pdl in (False, True):
                records = record_chain(kernel, sets, pdl, args.replays)
                mode = "pdl" if pdl else "plain"
                summary = {"shape": spec, "variant": name, "mode": mode, "grid": grid, "items": n_items}
                summary.update(summarize(records, n_items))
                result["summaries"].append(summary)
                arrays[f"{name}_{spec}_{mode}"] = records
                print(json.dumps(summary), flush=True)
        del sets
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "timeline.json").write_text(json.dumps(result, indent=1))
    np.savez_compressed(args.out / "timeline.npz", **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
