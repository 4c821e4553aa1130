"""The mmproj GGUF: a vision tower and its projector into the language model, as llama.cpp's
`clip` loader reads them (`general.architecture = "clip"`, keys `clip.vision.*`, tensors `v.*`
and `mm.*`).

Covered: LLaVA-1.5-style files, a CLIP ViT (class token, pre-LayerNorm, quick-GELU or GELU MLP)
with the `mlp` projector (Linear, GELU, Linear). Refused with a message: other projector types,
anyres tiling (`image_grid_pinpoints`, LLaVA-1.6) and stacked feature layers.

Two facts of real files:
* The LLaVA converter stores the tower without its last layer (`block_count` = layers - 1): the
  projector was trained on the second-to-last layer's output. Every stored layer runs.
* Older converters stored CLIP's `fc1` as `ffn_down` and `fc2` as `ffn_up`; the shapes tell
  which is which (as llama.cpp's loader decides), so both spellings load.

`write_mmproj` writes such a file (F16 matrices, F32 vectors, as the converter does);
`from_transformers` maps a transformers CLIP vision tower and LLaVA projector onto it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

PROJECTORS = ("mlp",)


@dataclass(frozen=True)
class VisionArgs:
    image_size: int
    patch_size: int
    dim: int
    ffn_dim: int
    n_layers: int
    n_heads: int
    projection_dim: int  # the language model's embedding width
    norm_eps: float = 1e-5
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    activation: str = "quick"  # kernels/gelu kinds: "quick" (CLIP), "erf" (clip.use_gelu)
    projector: str = "mlp"
    has_class_token: bool = True
    has_pre_norm: bool = True
    has_post_norm: bool = False

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def n_image_tokens(self) -> int:
        """Embeddings one image becomes in the prompt (the class token is dropped)."""
        return self.patches_per_side**2


def _layer_names(i: int) -> list[str]:
    b = f"v.blk.{i}"
    return [f"{b}.{part}.{kind}" for part in ("ln1", "attn_q", "attn_k", "attn_v", "attn_out", "ln2", "ffn_up", "ffn_down")
            for kind in ("weight", "bias")]


def tensor_shapes(args: VisionArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the encoder uses, in torch layout ([out, in] for matrices)."""
    d, f, p = args.dim, args.ffn_dim, args.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "v.patch_embd.weight": (d, 3, p, p),
        "v.position_embd.weight": (args.n_image_tokens + int(args.has_class_token), d),
        "mm.0.weight": (args.projection_dim, d),
        "mm.0.bias": (args.projection_dim,),
        "mm.2.weight": (args.projection_dim, args.projection_dim),
        "mm.2.bias": (args.projection_dim,),
    }
    if args.has_class_token:
        shapes["v.class_embd"] = (d,)
    for norm, present in (("v.pre_ln", args.has_pre_norm), ("v.post_ln", args.has_post_norm)):
        if present:
            shapes[f"{norm}.weight"] = shapes[f"{norm}.bias"] = (d,)
    for i in range(args.n_layers):
        for name in _layer_names(i):
            part = name.split(".")[3]
            if name.endswith(".bias"):
                shapes[name] = (f,) if part == "ffn_up" else (d,)
            elif part in ("ln1", "ln2"):
                shapes[name] = (d,)
            elif part == "ffn_up":
                shapes[name] = (f, d)
            elif part == "ffn_down":
                shapes[name] = (d, f)
            else:
                shapes[name] = (d, d)
    return shapes


def _swap_ffn_if_needed(args: VisionArgs, weights: dict[str, Tensor]) -> None:
    for i in range(args.n_layers):
        up, down = f"v.blk.{i}.ffn_up", f"v.blk.{i}.ffn_down"
        if weights[f"{up}.weight"].shape == (args.dim, args.ffn_dim) != (args.ffn_dim, args.dim):
            for kind in ("weight", "bias"):
                weights[f"{up}.{kind}"], weights[f"{down}.{kind}"] = weights[f"{down}.{kind}"], weights[f"{up}.{kind}"]


def load_mmproj(path: str | Path) -> tuple[VisionArgs, dict[str, Tensor]]:
    """(config, fp32 weights on the CPU) from an mmproj GGUF; a clear error for what is not covered."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))

    def optional(key: str) -> Any:
        value = reader.get_field(key)
        return None if value is None else value.contents()

    def field(key: str) -> Any:
        value = optional(key)
        if value is None:
            raise ValueError(f"{path}: no metadata key {key!r}; is this an mmproj file?")
        return value

    if optional("general.architecture") != "clip":
        raise ValueError(f"{path}: general.architecture is {optional('general.architecture')!r}, not 'clip': not an mmproj file")
    if optional("clip.has_vision_encoder") is False:
        raise ValueError(f"{path}: the file has no vision encoder (audio-only projectors are not covered)")
    projector = optional("clip.vision.projector_type") or optional("clip.projector_type") or "mlp"
    if projector not in PROJECTORS:
        raise ValueError(f"{path}: projector type {projector!r}; covered: {', '.join(PROJECTORS)} (LLaVA-1.5 style)")
    if optional("clip.vision.image_grid_pinpoints"):
        raise ValueError(f"{path}: anyres tiling (clip.vision.image_grid_pinpoints, LLaVA-1.6) is not covered")
    if len(optional("clip.vision.feature_layer") or []) > 1:
        raise ValueError(f"{path}: stacked feature layers (clip.vision.feature_layer) are not covered")

    weights: dict[str, Tensor] = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        weights[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32))
    if "mm.2.weight" not in weights:
        raise ValueError(f"{path}: a one-layer mlp projector (no mm.2) is not covered")
    image_size, patch = int(field("clip.vision.image_size")), int(field("clip.vision.patch_size"))
    feature = optional("clip.vision.feature_layer")
    n_layers = int(field("clip.vision.block_count"))
    if feature:
        if not 0 < int(feature[0]) <= n_layers:
            raise ValueError(f"{path}: clip.vision.feature_layer {feature[0]} is not one of the {n_layers} stored layers")
        n_layers = int(feature[0])
    args = VisionArgs(
        image_size=image_size,
        patch_size=patch,
        dim=int(field("clip.vision.embedding_length")),
        ffn_dim=int(field("clip.vision.feed_forward_length")),
        n_layers=n_layers,
        n_heads=int(field("clip.vision.attention.head_count")),
        projection_dim=int(weights["mm.2.weight"].shape[0]),
        norm_eps=float(field("clip.vision.attention.layer_norm_epsilon")),
        image_mean=tuple(float(v) for v in field("clip.vision.image_mean")[:3]),  # type: ignore[arg-type]
        image_std=tuple(float(v) for v in field("clip.vision.image_std")[:3]),  # type: ignore[arg-type]
        activation="erf" if optional("clip.use_gelu") else "quick",
        projector=projector,
        has_class_token="v.class_embd" in weights,
        has_pre_norm="v.pre_ln.weight" in weights,
        has_post_norm="v.post_ln.weight" in weights,
    )
    if args.image_size % args.patch_size:
        raise ValueError(f"{path}: image size {image_size} is not a whole number of {patch}-pixel patches")
    _swap_ffn_if_needed(args, weights)
    shapes = tensor_shapes(args)
    missing = [name for name in shapes if name not in weights]
    if missing:
        raise ValueError(f"{path}: tensors missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{path}: {name} is {tuple(weights[name].shape)}, expected {shape}")
    return args, weights


def write_mmproj(path: str | Path, args: VisionArgs, weights: dict[str, Tensor]) -> Path:
    """An mmproj GGUF as llama.cpp's LLaVA converter writes one: F16 matrices and patch kernel,
    F32 vectors. `weights` must hold every name of `tensor_shapes(args)`."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch="clip")
    writer.add_name("loom-mmproj")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_string("clip.projector_type", args.projector)
    writer.add_bool("clip.use_gelu", args.activation == "erf")
    writer.add_uint32("clip.vision.image_size", args.image_size)
    writer.add_uint32("clip.vision.patch_size", args.patch_size)
    writer.add_uint32("clip.vision.embedding_length", args.dim)
    writer.add_uint32("clip.vision.feed_forward_length", args.ffn_dim)
    writer.add_uint32("clip.vision.projection_dim", args.projection_dim)
    writer.add_uint32("clip.vision.attention.head_count", args.n_heads)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", args.norm_eps)
    writer.add_uint32("clip.vision.block_count", args.n_layers)
    writer.add_array("clip.vision.image_mean", list(args.image_mean))
    writer.add_array("clip.vision.image_std", list(args.image_std))
    for name, shape in tensor_shapes(args).items():
        value = weights[name].detach().float().cpu()
        if tuple(value.shape) != shape:
            raise ValueError(f"{name} is {tuple(value.shape)}, expected {shape}")
        array = value.numpy()
        writer.add_tensor(name, array.astype(np.float16) if array.ndim >= 2 else array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def from_transformers(vision: dict[str, Tensor], projector: dict[str, Tensor], layers: int) -> dict[str, Tensor]:
    """Our tensor names for a transformers CLIPVisionModel state dict (`vision`; keys with or
    without the `vision_model.` of older versions) and a LlavaMultiModalProjector's
    (`projector`), keeping the tower's first `layers` layers."""
    vision = {name.removeprefix("vision_model."): value for name, value in vision.items()}
    out: dict[str, Tensor] = {
        "v.patch_embd.weight": vision["embeddings.patch_embedding.weight"],
        "v.class_embd": vision["embeddings.class_embedding"],
        "v.position_embd.weight": vision["embeddings.position_embedding.weight"],
        "v.pre_ln.weight": vision["pre_layrnorm.weight"],
        "v.pre_ln.bias": vision["pre_layrnorm.bias"],
        "mm.0.weight": projector["linear_1.weight"],
        "mm.0.bias": projector["linear_1.bias"],
        "mm.2.weight": projector["linear_2.weight"],
        "mm.2.bias": projector["linear_2.bias"],
    }
    parts = {"layer_norm1": "ln1", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "layer_norm2": "ln2",
             "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
    for i in range(layers):
        for hf, ours in parts.items():
            for kind in ("weight", "bias"):
                out[f"v.blk.{i}.{ours}.{kind}"] = vision[f"encoder.layers.{i}.{hf}.{kind}"]
    return out
