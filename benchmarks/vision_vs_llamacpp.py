"""Our image embeddings against llama.cpp's (`mtmd`, through the llama-cpp-python binding) on the
same mmproj file.

    python benchmarks/vision_vs_llamacpp.py [--gguf LM.gguf --mmproj MMPROJ.gguf] [--device cpu|cuda]

Without files, a tiny llama model and a tiny LLaVA-style mmproj are written by our writers, so
both sides read the very same bytes. The image is a square of the tower's own size, so neither
side's resize changes a pixel and only the towers differ.

Reported (one JSON line): the largest absolute difference between llama.cpp's embeddings and
ours, and between llama.cpp's and our weights run the way llama.cpp's graph runs them, both
against the largest embedding. llama.cpp's graph for LLaVA-projector files runs one stored layer
fewer than the file holds, puts the class token after the patches, and then drops the first row
(a patch, not the class token): llama.cpp issue 25817. If the second figure is small, llama.cpp
reads our file as we mean it, and the first figure is that graph's doing.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.llama_q4k.mmproj import VisionArgs, load_mmproj, tensor_shapes, write_mmproj  # noqa: E402
from kernels.llama_q4k.vision import VisionEncoder, preprocess  # noqa: E402
from kernels.llama_q4k.weights import write_tiny_model  # noqa: E402

VOCAB = ROOT / "tests" / "fixtures" / "gguf" / "ggml-vocab-phi-3.gguf"
TINY = VisionArgs(image_size=56, patch_size=14, dim=64, ffn_dim=128, n_layers=2, n_heads=4, projection_dim=256)


def tiny_mmproj(path: Path, args: VisionArgs = TINY, seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in tensor_shapes(args).items():
        norm = name.endswith(("ln1.weight", "ln2.weight", "pre_ln.weight"))
        weights[name] = (1.0 if norm else 0.0) + 0.1 * torch.randn(shape, generator=generator)
    return write_mmproj(path, args, weights)


def llamacpp_embeddings(lm: Path, mmproj: Path, pixels: np.ndarray, gpu: bool) -> np.ndarray:
    """llama.cpp's embeddings [tokens, dim] for one RGB image (uint8 [h, w, 3])."""
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    model = llama_cpp.Llama(str(lm), n_ctx=256, n_gpu_layers=-1 if gpu else 0, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.warmup = gpu, False
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), model.model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not load {mmproj}")
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        height, width, _ = pixels.shape
        data = (ctypes.c_uint8 * pixels.size).from_buffer_copy(np.ascontiguousarray(pixels).tobytes())
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(mtmd.mtmd_bitmap_init(width, height, data))
        text = mtmd.mtmd_input_text()
        prompt = mtmd.mtmd_default_marker()
        text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), False, True
        if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
            raise RuntimeError("mtmd_tokenize failed")
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == 1:  # an image
                if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                    raise RuntimeError("mtmd_encode_chunk failed")
                tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                out = mtmd.mtmd_get_output_embd(ctx)
                dim = model.n_embd()
                return np.ctypeslib.as_array(out, shape=(tokens * dim,)).copy().reshape(tokens, dim)
        raise RuntimeError("no image chunk in llama.cpp's tokens")
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_free(ctx)


@torch.inference_mode()
def as_llamacpp_graph(encoder: VisionEncoder, pixels: torch.Tensor) -> torch.Tensor:
    """Our weights run the way llama.cpp's LLaVA graph runs them (see the module docstring)."""
    args = dataclasses.replace(encoder.args, n_layers=encoder.args.n_layers - 1)
    w = encoder.w
    x = encoder.patches(pixels[None].to(encoder.dtype)) @ w["v.patch_embd.weight"].T
    x = torch.cat([x, w["v.class_embd"].expand(1, 1, args.dim)], dim=1) + w["v.position_embd.weight"]
    x = encoder._norm(x, None, "v.pre_ln")[1]
    delta = None
    for i in range(args.n_layers):
        x, h = encoder._norm(x, delta, f"v.blk.{i}.ln1")
        x, h = encoder._norm(x, encoder._attention(h, i), f"v.blk.{i}.ln2")
        delta = encoder._mlp(h, i)
    x = (x + delta if delta is not None else x)[:, 1:]
    x = F.gelu(x @ w["mm.0.weight"].T + w["mm.0.bias"])
    return (x @ w["mm.2.weight"].T + w["mm.2.bias"])[0]


def compare(lm: Path, mmproj: Path, device: str = "cpu", seed: int = 0) -> dict:
    from PIL import Image

    args, weights = load_mmproj(mmproj)
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
    theirs = torch.from_numpy(llamacpp_embeddings(lm, mmproj, rgb, gpu=device == "cuda"))
    encoder = VisionEncoder(args, weights, device=device)
    pixels = preprocess(Image.fromarray(rgb), args).to(device)
    ours = encoder(pixels)[0].cpu()
    emulated = as_llamacpp_graph(encoder, pixels).cpu()
    scale = float(theirs.abs().max())
    return {
        "tokens": list(theirs.shape),
        "largest_embedding": scale,
        "ours_vs_llamacpp_max_abs": float((ours - theirs).abs().max()),
        "llamacpp_graph_vs_llamacpp_max_abs": float((emulated - theirs).abs().max()),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", help="the language model llama.cpp needs beside the mmproj")
    parser.add_argument("--mmproj")
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        lm = Path(opts.gguf) if opts.gguf else write_tiny_model(Path(scratch) / "lm.gguf", "llama", VOCAB, dense=True)
        mmproj = Path(opts.mmproj) if opts.mmproj else tiny_mmproj(Path(scratch) / "mmproj.gguf")
        result = compare(lm, mmproj, opts.device)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
