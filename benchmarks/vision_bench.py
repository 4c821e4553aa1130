"""Image encode time of the vision tower, our kernels against the same tower in plain PyTorch ops,
and optionally the time to first token of a model program with an image in its prompt.

    python benchmarks/vision_bench.py                       # CLIP ViT-L/14-336 + LLaVA projector, random weights
    python benchmarks/vision_bench.py --mmproj FILE --gguf LM.gguf --runs 20

Without --mmproj the tower has LLaVA-1.5's shapes (23 stored layers of width 1024, 16 heads,
576 patches, a projector to 4096) with random fp16-rounded weights, written by our writer and
read back by our loader. Each figure is the median of --runs timed calls after warm-up, with
the min and max; CUDA events bracket the GPU work. One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.llama_q4k.mmproj import VisionArgs, load_mmproj, tensor_shapes, write_mmproj  # noqa: E402
from kernels.llama_q4k.vision import VISION_KERNEL_OPS, VISION_TORCH_OPS, VisionEncoder  # noqa: E402

LLAVA_15 = VisionArgs(image_size=336, patch_size=14, dim=1024, ffn_dim=4096, n_layers=23, n_heads=16, projection_dim=4096)


def random_mmproj(path: Path, args: VisionArgs) -> Path:
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in tensor_shapes(args).items():
        if name.endswith(("ln1.weight", "ln2.weight", "pre_ln.weight")):
            weights[name] = 1.0 + 0.05 * torch.randn(shape, generator=generator)
        else:
            weights[name] = 0.02 * torch.randn(shape, generator=generator)
    return write_mmproj(path, args, weights)


def timed(fn, device: torch.device, runs: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mmproj", help="an mmproj GGUF (default: LLaVA-1.5 shapes, random weights)")
    parser.add_argument("--gguf", help="a model program for the time to first token with one image")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--runs", type=int, default=20)
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(opts.mmproj) if opts.mmproj else random_mmproj(Path(scratch) / "mmproj.gguf", LLAVA_15)
        args, weights = load_mmproj(path)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "dtype": str(dtype), "tower": {"layers": args.n_layers, "dim": args.dim,
                                                   "image_tokens": args.n_image_tokens}}
    kernels = VisionEncoder(args, weights, device, dtype, VISION_KERNEL_OPS)
    plain = VisionEncoder(args, weights, device, dtype, VISION_TORCH_OPS)
    for batch in opts.batch:
        pixels = torch.randn(batch, 3, args.image_size, args.image_size, device=device)
        result[f"encode_b{batch}_kernels"] = timed(lambda p=pixels: kernels(p), device, opts.runs)
        result[f"encode_b{batch}_torch_ops"] = timed(lambda p=pixels: plain(p), device, opts.runs)
        result[f"encode_b{batch}_max_abs_diff"] = float((kernels(pixels).float() - plain(pixels).float()).abs().max())
    if opts.gguf:
        from PIL import Image

        from kernels.llama_q4k.chat import TextModel
        from kernels.llama_q4k.sampling import SamplingParams

        model = TextModel(opts.gguf, device, max_seq=2048, mmproj=str(path))
        image = Image.new("RGB", (640, 480), (90, 140, 200))
        messages = [{"role": "user", "content": "Describe the picture."}]
        replies = [model.chat(messages, SamplingParams(), 32, images=[image]) for _ in range(max(3, opts.runs // 4))]
        replies = replies[1:]  # the first call compiles and captures
        result["ttft_with_image_ms"] = statistics.median(r.prefill_s for r in replies) * 1e3
        result["decode_tok_s"] = statistics.median(len(r.tokens) / r.decode_s for r in replies if r.decode_s > 0)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
