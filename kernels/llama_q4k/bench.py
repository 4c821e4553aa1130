"""Benchmark the Llama Q4_K model end to end and check its logits; prints one JSON line.

    python -m kernels.llama_q4k.bench --gguf PATH [--prompt-len 512] [--gen 64] [--batch 1]
    python -m kernels.llama_q4k.bench --random-config tiny|llama3-8b [...] [--device auto]

Steps:
1. Warm-up: one full generation (Triton compiles here, and on CUDA the decode step is
   captured as a graph).
2. `--runs` timed generations. Each one runs prefill of a random prompt, then `--gen` greedy
   decode steps. TTFT is prefill plus the first argmax. Timing uses CUDA events on a GPU and
   perf_counter on the CPU.
3. Peak memory. On a GPU, torch.cuda.max_memory_allocated over building and running the model
   (the weights load to the CPU first). On the CPU, the process's peak RSS, reading included.
4. The logits check. One more generation keeps the logits at every position. These are
   compared with `reference_logits`: fp32 plain PyTorch on the same dequantized weights,
   teacher-forced with the same tokens.
5. The bf16 baseline: the same model in plain PyTorch with bf16 dense weights, timed on prefill
   of the same prompt.
6. The decode ceiling: the device's copy bandwidth (measured here, read + write bytes of a
   `copy_` of 1 GiB on a GPU, 256 MiB on the CPU) divided by the bytes one decode step reads
   (every weight, the embedding rows of the batch's tokens, and the whole KV cache, which the
   masked attention reads at every step); `decode_fraction_of_ceiling` is batch-1 decode
   against it.

On the CPU, the kernels take their torch paths unless TRITON_INTERPRET=1 is set
before the run (which is slow, and meant for tiny checks); `kernel_path` says which ran.
llama3-8b random weights need a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
from collections import Counter

import numpy as np
import torch
import triton

from kernels.llama_q4k.generate import Clock, DecodeStep, generate
from kernels.llama_q4k.model import CONFIGS, TORCH_OPS, Transformer, reference_logits
from kernels.llama_q4k.weights import load_gguf, random_weights
from kernels.q4k_gemv.q4k_gemv_cuda import cuda_gemv_b1

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of `dst.copy_(src)`, read and write bytes counted; median of 20 (GPU,
    CUDA events, 1 GiB) or 5 (CPU, perf_counter, 256 MiB) after warm-up."""
    size = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(size // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    clock = Clock(device)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20 if device.type == "cuda" else 5):
        clock.sync()
        start = clock.now()
        dst.copy_(src)
        end = clock.now()
        clock.sync()
        times.append(clock.ms(start, end) / 1e3)
    del src, dst
    return 2 * size / statistics.median(times)


def decode_bytes_per_step(model: torch.nn.Module, batch: int) -> dict[str, int]:
    """What one decode step reads: every buffer but the embedding table (one row per token)
    and the KV cache (counted whole: the masked attention reads all of it)."""
    weights = kv = 0
    for name, buffer in model.named_buffers():
        size = buffer.numel() * buffer.element_size()
        if name.endswith(("kv_cache.k", "kv_cache.v")):
            kv += size
        elif name == "tok_embeddings.weight":
            weights += batch * size // buffer.shape[0]
        elif buffer.is_floating_point() or buffer.dtype == torch.uint8:
            weights += size
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="a llama GGUF file (Q4_K linears)")
    source.add_argument("--random-config", choices=sorted(CONFIGS), help="random Q4_K weights")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen", type=int, default=64, help="decode steps")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="activations and KV cache (auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    parser.add_argument("--runs", type=int, default=3, help="timed generations")
    parser.add_argument(
        "--prefill-runs",
        type=int,
        default=10,
        help="timed prefills of each model (ours and the bf16 one)",
    )
    parser.add_argument("--reference", default="bf16", choices=["bf16", "none"])
    parser.add_argument("--no-graph", action="store_true", help="decode eagerly on CUDA too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace",
        help="also write a Kineto (Chrome JSON) trace of 3 eager decode steps here: every kernel "
        "of a step, for `analyze_trace` (graph replay hides them)",
    )
    return parser.parse_args(argv)


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "cpu_peak_rss"


def time_prefill(model: Transformer, prompt: torch.Tensor, runs: int) -> list[float]:
    """ms of each of `runs` last-position prefills (after one warm-up)."""
    clock = Clock(prompt.device)
    input_pos = torch.arange(prompt.shape[1], device=prompt.device)
    times = []
    for _ in range(runs + 1):
        clock.sync()
        start = clock.now()
        model(prompt, input_pos, last_only=True)
        end = clock.now()
        clock.sync()
        times.append(clock.ms(start, end))
    return times[1:]


def spread(times: list[float]) -> dict[str, float]:
    """Median and the 10th/90th percentiles of a list of ms."""
    return {
        "median": statistics.median(times),
        "p10": float(np.percentile(times, 10)),
        "p90": float(np.percentile(times, 90)),
        "n": len(times),
    }


@torch.inference_mode()
def trace_decode(model: Transformer, prompt: torch.Tensor, path: str, steps: int = 3) -> None:
    """A Kineto trace of `steps` eager decode steps after the prompt (CPU and, on a GPU, CUDA
    activities). Eager, so that each kernel of the step is its own event."""
    from torch.profiler import ProfilerActivity, profile

    device = prompt.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # The prompt's last position again: inside the cache whatever --gen is, and the step's
    # kernels and shapes are those of any decode step.
    tokens, position = prompt[:, -1:], torch.tensor([prompt.shape[1] - 1], device=device)
    with torch.no_grad():
        model(tokens, position)  # warm
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                model(tokens, position)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)


def main(argv: list[str] | None = None) -> dict:
    opts = parse_args(argv)
    if (
        opts.runs < 1
        or opts.prefill_runs < 1
        or opts.prompt_len < 1
        or opts.gen < 0
        or opts.batch < 1
    ):
        raise SystemExit(
            "need --runs >= 1, --prefill-runs >= 1, --prompt-len >= 1, --gen >= 0, --batch >= 1"
        )
    if opts.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(opts.device)
    if opts.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = DTYPES[opts.dtype]
    if opts.random_config == "llama3-8b" and device.type != "cuda":
        raise SystemExit("--random-config llama3-8b needs a GPU (--device cuda)")

    copy_bytes_per_s = copy_bandwidth(device)  # before the model takes the device's memory
    if opts.gguf:
        args, weights, types = load_gguf(opts.gguf)
    else:
        args = CONFIGS[opts.random_config]
        weights = random_weights(args, opts.seed, device=str(device))
        types = {name: "Q4_K" if w.dtype == torch.uint8 else "F32" for name, w in weights.items()}
    if opts.prompt_len + opts.gen > args.context_length:
        raise SystemExit(f"prompt + gen exceeds the model's context length {args.context_length}")

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = Transformer(args, weights, device=device, dtype=dtype)
    model.setup_caches(opts.batch, opts.prompt_len + opts.gen)
    step_bytes = decode_bytes_per_step(model, opts.batch)
    use_graph = device.type == "cuda" and not opts.no_graph
    decode = DecodeStep(model, opts.batch, use_graph)

    generator = torch.Generator().manual_seed(opts.seed)
    prompt = torch.randint(0, args.vocab_size, (opts.batch, opts.prompt_len), generator=generator)
    prompt = prompt.to(device)
    generate(model, decode, prompt, opts.gen)  # warm-up
    runs = [generate(model, decode, prompt, opts.gen) for _ in range(opts.runs)]
    memory, memory_source = peak_memory(device)

    ttft = statistics.median(run.ttft_ms for run in runs)
    steps = np.array([ms for run in runs for ms in run.step_ms])
    checked = generate(model, decode, prompt, opts.gen, keep_logits=True)
    assert checked.logits is not None
    sequence = torch.cat([prompt, checked.tokens[:, :-1]], dim=1)
    expected = reference_logits(args, weights, sequence)
    max_abs_diff = (checked.logits - expected).abs().max().item()
    top1 = (checked.logits.argmax(dim=-1) == expected.argmax(dim=-1)).float().mean().item()
    max_abs_logit = expected.abs().max().item()
    # Prefill alone, timed the same way as the bf16 model's below (a generation's TTFT also
    # holds the first argmax and, with one or two runs, says little about spread).
    prefill_times = time_prefill(model, prompt, opts.prefill_runs)
    if opts.trace:
        trace_decode(model, prompt, opts.trace)
    del model, decode, checked  # room for the bf16 model on the device

    bf16_times: list[float] = []
    control: dict[str, float] = {}
    if opts.reference == "bf16":
        dense = Transformer(
            args, weights, device=device, dtype=torch.bfloat16, ops=TORCH_OPS, dequantize=True
        )
        dense.setup_caches(opts.batch, sequence.shape[1])
        bf16_times = time_prefill(dense, prompt, opts.prefill_runs)
        # The control for the logits check: plain PyTorch in bf16 on the same weights and tokens
        # against the same fp32 reference. Our kernels' figures mean something only beside what
        # bf16 arithmetic alone does to this model.
        dense_logits = dense(sequence, torch.arange(sequence.shape[1], device=device)).float()
        control = {
            "max_abs_diff": (dense_logits - expected).abs().max().item(),
            "top1_agreement": (dense_logits.argmax(-1) == expected.argmax(-1))
            .float()
            .mean()
            .item(),
        }
        del dense, dense_logits
    del expected

    ours = spread(prefill_times)
    bf16 = spread(bf16_times) if bf16_times else None
    bf16_prefill_ms = bf16["median"] if bf16 else None
    prompt_tokens = opts.batch * opts.prompt_len
    decode_s = steps.sum() / 1e3
    decode_tps = opts.batch * len(steps) / decode_s if len(steps) else None
    ceiling_tps = opts.batch * copy_bytes_per_s / step_bytes["total"]
    on_gpu = device.type == "cuda"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    result = {
        "model": opts.gguf or f"random:{opts.random_config}",
        "config": {
            "dim": args.dim,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "n_kv_heads": args.n_kv_heads,
            "ffn_dim": args.ffn_dim,
            "vocab_size": args.vocab_size,
        },
        "tensor_types": dict(Counter(types.values())),
        # Everything but Q4_K is loaded as fp32 (and cast to dtype if it is a matrix).
        "dequantized_at_load": dict(Counter(t for t in types.values() if t != "Q4_K")),
        "batch": opts.batch,
        "prompt_len": opts.prompt_len,
        "gen": opts.gen,
        "runs": opts.runs,
        "dtype": str(dtype).removeprefix("torch."),
        "ttft_ms": ttft,
        "prefill_tokens_per_s": prompt_tokens / (ttft / 1e3),
        "decode_tokens_per_s": decode_tps,
        "per_token_latency_ms_p50": float(np.percentile(steps, 50)) if len(steps) else None,
        "per_token_latency_ms_p95": float(np.percentile(steps, 95)) if len(steps) else None,
        "peak_device_memory_bytes": memory,
        "peak_memory_source": memory_source,
        "max_abs_diff": max_abs_diff,
        "max_abs_logit": max_abs_logit,
        "top1_agreement": top1,
        "checked_positions": opts.batch * (opts.prompt_len + opts.gen),
        "reference": "fp32 plain PyTorch on the same dequantized weights",
        "bf16_torch_vs_reference": control or None,
        "copy_bandwidth_bytes_per_s": copy_bytes_per_s,
        "decode_step_bytes": step_bytes,
        "decode_ceiling_tokens_per_s": ceiling_tps,
        "decode_fraction_of_ceiling": decode_tps / ceiling_tps if decode_tps else None,
        "prefill_ms": ours,
        "bf16_prefill_ms": bf16_prefill_ms,
        "bf16_prefill_spread_ms": bf16,
        "prefill_speedup_vs_bf16": bf16_prefill_ms / ours["median"] if bf16 else None,
        "bf16_prefill_tokens_per_s": prompt_tokens / (bf16_prefill_ms / 1e3)
        if bf16_prefill_ms is not None
        else None,
        # batch-1 decode GEMVs on the q4k_gemv CUDA kernel where it is built
        "kernel_path": ("cuda+triton" if cuda_gemv_b1(device) is not None else "triton")
        if on_gpu
        else "triton" if interpreted else "torch-fallback",
        "decode_linear": "q4k_gemv candidate",
        "prefill_linear": "q4k_gemm candidate (Triton dequantization + dense matmul)",
        "graph_capture": use_graph,
        "decode_trace": opts.trace,
        "device": torch.cuda.get_device_name(device)
        if on_gpu
        else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
