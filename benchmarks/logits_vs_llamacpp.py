"""Our model program's logits against llama.cpp's on the same GGUF files, family by family.

    python benchmarks/logits_vs_llamacpp.py [--families llama,qwen2,qwen3,phi3] [--gguf FILE ...]
                                            [--device cpu|cuda] [--json OUT]

Without --gguf, a tiny model of each family is written by our writer around a real vocabulary
(tests/fixtures/gguf: Phi-3's), so llama.cpp and our loader read the very same file. Each file
runs a fixed prompt set through llama.cpp (the `llama_cpp` Python binding: pip install
llama-cpp-python, built with CUDA on a GPU machine) with every position's logits kept, and
through kernels/llama_q4k. Reported per file: top-1 agreement over all positions, the largest
and the mean absolute logit difference (also relative to the largest logit); the issue's bar
is top-1 >= 99 %.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.llama_q4k.model import KERNEL_OPS, TORCH_OPS  # noqa: E402
from kernels.llama_q4k.tokenizer import GGUFTokenizer  # noqa: E402
from kernels.llama_q4k.weights import build_model, load_gguf, write_tiny_model  # noqa: E402

VOCAB = ROOT / "tests" / "fixtures" / "gguf" / "ggml-vocab-phi-3.gguf"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "In 1969, Apollo 11 landed on the Moon; 600 million people watched.",
]


def context_for(ids: list[int]) -> int:
    """The KV cache length both sides get (LongRoPE picks its factors by it, as llama.cpp does)."""
    return max(64, len(ids) + 8)


def llamacpp_logits(path: Path, ids: list[int], gpu: bool) -> np.ndarray:
    from llama_cpp import Llama

    model = Llama(
        model_path=str(path), logits_all=True, n_ctx=context_for(ids), n_gpu_layers=-1 if gpu else 0,
        verbose=False, seed=0,
    )
    model.reset()
    model.eval(ids)
    return np.array(model.scores[: len(ids)], dtype=np.float32)


def our_logits(path: Path, ids: list[int], device: str) -> np.ndarray:
    args, weights, _ = load_gguf(path)
    cuda = device == "cuda"
    model = build_model(args, weights, device=device, dtype=torch.float32, ops=KERNEL_OPS if cuda else TORCH_OPS)
    model.setup_caches(1, context_for(ids))
    with torch.no_grad():
        out = model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device))
    return out[0].float().cpu().numpy()


def compare(path: Path, device: str) -> dict:
    tok = GGUFTokenizer(path)
    agree = total = 0
    worst = mean_sum = 0.0
    largest = 0.0
    for text in PROMPTS:
        ids = tok.encode(text)
        theirs = llamacpp_logits(path, ids, device == "cuda")
        mine = our_logits(path, ids, device)
        diff = np.abs(mine - theirs)
        agree += int((mine.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, float(diff.max()))
        mean_sum += float(diff.mean()) * len(ids)
        largest = max(largest, float(np.abs(theirs).max()))
    return {
        "file": path.name,
        "positions": total,
        "top1_agreement": agree / total,
        "max_abs_diff": worst,
        "mean_abs_diff": mean_sum / total,
        "max_rel_diff": worst / largest if largest else None,
    }


def with_rope_scaling(path: Path, kind: str, original: int = 16, factor: float = 4.0) -> Path:
    """`path` rewritten with a rope scaling over a short original context, so prompts of 20-40
    tokens run mostly in the scaled range. LongRoPE's factors: random short ones, long ones
    growing to 30 (its attention factor as llama.cpp's converter computes it)."""
    import dataclasses
    import math

    from kernels.llama_q4k.weights import write_gguf

    args, weights, types = load_gguf(path)
    if kind == "longrope":
        half = args.head_dim // 2
        weights["rope_factors_short.weight"] = 1.0 + 0.5 * torch.rand(half, generator=torch.Generator().manual_seed(0))
        weights["rope_factors_long.weight"] = 1.0 + 30.0 * torch.linspace(0, 1, half) ** 2
        scale = args.context_length / original
        args = dataclasses.replace(args, rope_original_context=original,
                                   rope_attn_factor=math.sqrt(1 + math.log(scale) / math.log(original)))
    else:
        args = dataclasses.replace(args, rope_scaling_factor=factor, rope_original_context=original,
                                   rope_scaling_type="yarn" if kind == "yarn" else None)
    from gguf import GGMLQuantizationType

    quant = {name: GGMLQuantizationType[t] for name, t in types.items() if weights.get(name) is not None
             and weights[name].dtype == torch.uint8}
    out = path.with_name(f"{path.stem}-{kind}.gguf")
    write_gguf(out, args, weights, quant, vocab_from=VOCAB)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="llama,qwen2,qwen3,phi3,gemma2,gemma3")
    parser.add_argument("--gguf", nargs="*", default=[], help="compare these files instead of tiny ones")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dense", action="store_true", help="tiny models with F32 matrices (semantics only)")
    parser.add_argument("--rope", choices=["none", "linear", "yarn", "longrope"], default="none",
                        help="tiny models with this rope scaling over a 16-token original context")
    parser.add_argument("--json")
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="logits-"))
    kind = "f32" if opts.dense else "q4k"
    files = [Path(f) for f in opts.gguf] or [
        write_tiny_model(work / f"tiny-{a}-{kind}.gguf", a, VOCAB, opts.dense) for a in opts.families.split(",")
    ]
    if opts.rope != "none" and not opts.gguf:
        files = [with_rope_scaling(path, opts.rope) for path in files]
    rows = []
    for path in files:
        row = compare(path, opts.device)
        rows.append(row)
        print(
            f"{row['file']}: top-1 {row['top1_agreement']:.1%} of {row['positions']} positions, "
            f"max |diff| {row['max_abs_diff']:.3g} ({row['max_rel_diff']:.2g} of the largest logit), "
            f"mean {row['mean_abs_diff']:.3g}",
            flush=True,
        )
    if opts.json:
        Path(opts.json).write_text(json.dumps({"device": opts.device, "rows": rows}, indent=2))
    return 0 if all(r["top1_agreement"] >= 0.99 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
