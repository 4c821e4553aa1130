#!/usr/bin/env python3
"""Check and time the model program's decode attention (kernels/llama_q4k/decode_attention.py).

    python kernels/tools/probe_decode_attention.py [--out DIR]

At Llama-3-8B's attention (32 query heads, 8 KV heads of 128, bf16, batch 1): first each
variant's output and cache write are checked against the framework's path (rope_cache, then
scaled_dot_product_attention with a position mask); then each is timed as kernels/tools/sweep_q4k.py
times kernels: one call per layer's cache (32 caches, more than L2 holds) captured in one CUDA
graph, median and P10/P90 per call over replays. Variants: cache positions per program (chunk)
and warps per program, with programmatic dependent launch on and off (LOOM_Q4K_PDL).
Writes probe_decode_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sweep_q4k import time_rotating  # noqa: E402

from kernels.llama_q4k.decode_attention import decode_attention, torch_decode_attention  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 32
VARIANTS = [(64, 4), (32, 4), (128, 4), (64, 2), (64, 8), (32, 2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    result: dict = {"device": torch.cuda.get_device_name(), "cases": []}
    failures = 0
    for max_seq, position in [(576, 570), (4096, 4000), (576, 100)]:
        qkv = torch.randn(1, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device, dtype=dtype)
        q, k, v = (
            t.reshape(1, -1, HEAD_DIM)
            for t in qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        )
        positions = torch.tensor([position], device=device)
        caches = [
            [torch.randn(1, KV_HEADS, max_seq, HEAD_DIM, device=device, dtype=dtype) for _ in range(2)]
            for _ in range(LAYERS)
        ]
        case: dict = {"max_seq": max_seq, "position": position, "timings": {}, "checks": {}}
        plain = [c.clone() for c in caches[0]]
        want = torch_decode_attention(positions, q, k, v, inv_freq, *plain)
        for chunk, warps in VARIANTS:
            mine = [c.clone() for c in caches[0]]
            got = decode_attention(positions, q, k, v, inv_freq, *mine, chunk=chunk, num_warps=warps)
            diff = (got.float() - want.float()).abs().max().item()
            ok = diff <= 2**-6 * want.float().abs().max().item() and torch.equal(mine[1], plain[1])
            ok = ok and (mine[0].float() - plain[0].float()).abs().max().item() <= 2**-7 * 8
            case["checks"][f"c{chunk}_w{warps}"] = {"ok": ok, "max_abs_diff": diff}
            failures += not ok
        sets = [(c[0], c[1]) for c in caches]
        for pdl in ("1", "0"):
            os.environ["LOOM_Q4K_PDL"] = pdl
            for chunk, warps in VARIANTS:
                # the rotating caches are written by no kernel here: settled, as in the model
                ours = partial(
                    decode_attention, positions, q, k, v, inv_freq, settled_cache=True, chunk=chunk, num_warps=warps
                )
                med, p10, p90 = time_rotating(ours, sets, args.replays)
                case["timings"][f"c{chunk}_w{warps}_pdl{pdl}"] = [round(t * 1e6, 3) for t in (med, p10, p90)]
        os.environ.pop("LOOM_Q4K_PDL")
        framework = partial(torch_decode_attention, positions, q, k, v, inv_freq)
        med, p10, p90 = time_rotating(framework, sets, args.replays)
        case["timings"]["rope_cache+sdpa"] = [round(t * 1e6, 3) for t in (med, p10, p90)]
        print(json.dumps(case), flush=True)
        result["cases"].append(case)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_decode_attention.json").write_text(json.dumps(result, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
