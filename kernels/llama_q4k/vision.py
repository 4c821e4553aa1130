"""Image input: pixels as the mmproj file says, a CLIP vision tower on our kernels, and the
image's embeddings spliced into the prompt where the chat text marks it.

* `preprocess`: RGB, then LLaVA's pad-to-square in the mean colour (`pad`, what LLaVA-1.5 was
  trained with and llama.cpp does) or a shortest-edge resize and centre crop (`crop`, the
  transformers LLaVA processor), bicubic resize in Pillow, rescale by 1/255, normalize by the
  file's mean and std. Bit for bit what transformers' CLIP image processor gives (tested).
* `VisionEncoder`: patch embedding, class token, positions, pre-LayerNorm, pre-norm blocks, the
  class token dropped, the projector. Each residual add and the LayerNorm after it is one
  kernel (kernels/layernorm), each bias + GELU one kernel (kernels/gelu); matmuls run in the
  framework's dense GEMM and attention in F.scaled_dot_product_attention, as prefill does.
  Every stored layer runs (see mmproj.py); llama.cpp's graph for these files runs one layer
  fewer and puts the class token after the patches, so its embeddings differ from the trained
  model's (llama.cpp issue 25817).
* A prompt carries images as `IMAGE_MARKER` in its text; `tokenize` turns each into
  `n_image_tokens` placeholder slots, and `embed_prompt` fills them with the encoder's output.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.gelu.gelu import bias_gelu, torch_bias_gelu
from kernels.layernorm.layernorm import add_layer_norm, torch_add_layer_norm
from kernels.llama_q4k.mmproj import VisionArgs

if TYPE_CHECKING:
    from PIL.Image import Image

# What llama.cpp's multimodal tools put in a prompt's text where an image goes.
IMAGE_MARKER = "<__media__>"
# Pillow refuses larger images as decompression bombs; a request gets a 400 well before that.
# The side and aspect limits keep the padded square and the resized strip small: a 16000x1 PNG
# is 127 bytes.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
MAX_IMAGE_SIDE = 8192
MAX_ASPECT = 20
MAX_IMAGE_BYTES = 32 * 1024 * 1024


# ---------------------------------------------------------------- pixels


def decode_image(data: bytes) -> Image:
    """An image file's bytes as a Pillow image; ValueError for anything unreadable or too big."""
    from PIL import Image as PILImage

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    try:
        image = PILImage.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS or max(image.size) > MAX_IMAGE_SIDE:
            raise ValueError(
                f"the image is {image.width}x{image.height}; the limits are {MAX_IMAGE_PIXELS} pixels "
                f"and {MAX_IMAGE_SIDE} a side"
            )
        if max(image.size) > MAX_ASPECT * max(1, min(image.size)):
            raise ValueError(f"the image is {image.width}x{image.height}; sides more than {MAX_ASPECT}:1 are refused")
        image.load()
    except (OSError, PILImage.DecompressionBombError) as exc:
        raise ValueError(f"not a readable image: {exc}") from None
    return image


def image_from_data_url(url: str) -> Image:
    """`data:image/...;base64,...` as an image. Nothing is ever fetched: other URLs are refused."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError("image_url must be a data URL (data:image/...;base64,...); this server fetches nothing")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError("the image data URL must be base64 (data:image/png;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image data URL's base64 does not decode") from None
    return decode_image(data)


def pad_to_square(image: Image, mean: Sequence[float]) -> Image:
    """LLaVA's expand-to-square: the image centred on the longer side, in the mean colour."""
    from PIL import Image as PILImage

    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = PILImage.new(image.mode, (side, side), tuple(int(m * 255) for m in mean))
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


def preprocess(image: Image, args: VisionArgs, mode: str = "pad") -> Tensor:
    """float32 [3, size, size] normalized pixels. `mode`: "pad" (LLaVA, llama.cpp) or "crop"."""
    from PIL import Image as PILImage

    if mode not in ("pad", "crop"):
        raise ValueError(f"preprocess mode {mode!r}; one of pad, crop")
    image = image.convert("RGB")
    if mode == "pad":
        image = pad_to_square(image, args.image_mean)
    size = args.image_size
    width, height = image.size
    if width <= height:
        new = (size, int(size * height / width))
    else:
        new = (int(size * width / height), size)
    image = image.resize(new, resample=PILImage.Resampling.BICUBIC)
    pixels = np.asarray(image)  # [h, w, 3] uint8
    top, left = (pixels.shape[0] - size) // 2, (pixels.shape[1] - size) // 2
    pixels = pixels[top : top + size, left : left + size].transpose(2, 0, 1)
    scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(args.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(args.image_std, dtype=np.float32)[:, None, None]
    return torch.from_numpy(np.ascontiguousarray((scaled - mean) / std))


# ---------------------------------------------------------------- the encoder


class VisionOps(NamedTuple):
    # (x + delta, LayerNorm(x + delta)); delta may be None
    add_layer_norm: Callable[[Tensor, Tensor | None, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    # act(x + bias)
    bias_gelu: Callable[[Tensor, Tensor | None, str], Tensor]


VISION_KERNEL_OPS = VisionOps(add_layer_norm, bias_gelu)
VISION_TORCH_OPS = VisionOps(torch_add_layer_norm, torch_bias_gelu)


class VisionEncoder(nn.Module):
    """pixels [batch, 3, size, size] -> embeddings [batch, n_image_tokens, projection_dim]."""

    def __init__(
        self,
        args: VisionArgs,
        weights: dict[str, Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        ops: VisionOps = VISION_TORCH_OPS,
    ) -> None:
        super().__init__()
        self.args, self.ops, self.dtype = args, ops, dtype
        # The patch kernel as a matrix over flattened patches: one GEMM, no conv.
        self.w = {
            name: (w.reshape(w.shape[0], -1) if name == "v.patch_embd.weight" else w).to(device=device, dtype=dtype)
            for name, w in weights.items()
        }

    @property
    def device(self) -> torch.device:
        return self.w["mm.0.weight"].device

    def _norm(self, x: Tensor, delta: Tensor | None, name: str) -> tuple[Tensor, Tensor]:
        return self.ops.add_layer_norm(x, delta, self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.args.norm_eps)

    def _attention(self, h: Tensor, i: int) -> Tensor:
        a, w = self.args, self.w
        b = f"v.blk.{i}"
        batch, seq, _ = h.shape

        def heads(name: str) -> Tensor:
            y = F.linear(h, w[f"{b}.{name}.weight"], w[f"{b}.{name}.bias"])
            return y.view(batch, seq, a.n_heads, a.dim // a.n_heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads("attn_q"), heads("attn_k"), heads("attn_v"))
        y = y.transpose(1, 2).reshape(batch, seq, a.dim)
        return F.linear(y, w[f"{b}.attn_out.weight"], w[f"{b}.attn_out.bias"])

    def _mlp(self, h: Tensor, i: int) -> Tensor:
        b = f"v.blk.{i}"
        up = self.ops.bias_gelu(h @ self.w[f"{b}.ffn_up.weight"].T, self.w[f"{b}.ffn_up.bias"], self.args.activation)
        return F.linear(up, self.w[f"{b}.ffn_down.weight"], self.w[f"{b}.ffn_down.bias"])

    def patches(self, pixels: Tensor) -> Tensor:
        """[batch, n_patches, 3 * p * p] in the patch kernel's (channel, row, column) order."""
        p, n = self.args.patch_size, self.args.patches_per_side
        x = pixels.reshape(pixels.shape[0], 3, n, p, n, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(pixels.shape[0], n * n, 3 * p * p)

    @torch.inference_mode()
    def forward(self, pixels: Tensor, layers_out: list[Tensor] | None = None) -> Tensor:
        """`layers_out`, if given, gets the residual stream after the embeddings' pre-norm and
        after each layer (for comparing layer by layer)."""
        a, w = self.args, self.w
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        if pixels.dim() == 3:
            pixels = pixels[None]
        x = self.patches(pixels) @ w["v.patch_embd.weight"].T
        if "v.patch_embd.bias" in w:
            x = x + w["v.patch_embd.bias"]
        if a.has_class_token:
            x = torch.cat([w["v.class_embd"].expand(x.shape[0], 1, a.dim), x], dim=1)
        x = x + w["v.position_embd.weight"][: x.shape[1]]
        if a.has_pre_norm:
            x = self._norm(x, None, "v.pre_ln")[1]
        if layers_out is not None:
            layers_out.append(x)
        delta: Tensor | None = None
        for i in range(a.n_layers):
            x, h = self._norm(x, delta, f"v.blk.{i}.ln1")
            x, h = self._norm(x, self._attention(h, i), f"v.blk.{i}.ln2")
            delta = self._mlp(h, i)
            if layers_out is not None:
                layers_out.append(x + delta)
        x = x + delta if delta is not None else x
        if a.has_post_norm:
            x = self._norm(x, None, "v.post_ln")[1]
        if a.has_class_token:
            x = x[:, 1:]
        x = self.ops.bias_gelu(x @ w["mm.0.weight"].T, w["mm.0.bias"], "erf")
        return F.linear(x, w["mm.2.weight"], w["mm.2.bias"])


# ---------------------------------------------------------------- prompts with images


# Placeholder id in an image's slots: any valid id (the embeddings replace its row).
IMAGE_SLOT_ID = 0


@dataclass
class ImagePrompt:
    ids: list[int]
    image_starts: list[int]  # where each image's run of slots begins in ids


def tokenize(encode: Callable[..., list[int]], text: str, n_image_tokens: int, n_images: int, **kw: Any) -> ImagePrompt:
    """`text` with one IMAGE_MARKER per image, as ids with each marker a run of slots. The text
    between markers is tokenized piece by piece; only the first piece gets the BOS."""
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 != n_images:
        raise ValueError(f"the prompt marks {len(pieces) - 1} image(s) but {n_images} came with it")
    ids: list[int] = []
    starts: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            starts.append(len(ids))
            ids.extend([IMAGE_SLOT_ID] * n_image_tokens)
        if piece or i == 0:
            ids.extend(encode(piece, add_special=i == 0, **kw))
    return ImagePrompt(ids, starts)


def text_ids(ids: Sequence[int], image_starts: Sequence[int], n_image_tokens: int) -> list[int]:
    """The prompt without its image slots: a repetition penalty counts text tokens only."""
    slots = {i for start in image_starts for i in range(start, start + n_image_tokens)}
    return [t for i, t in enumerate(ids) if i not in slots]


def embed_prompt(embed: nn.Module, ids: Tensor, image_starts: Sequence[int], images: Sequence[Tensor]) -> Tensor:
    """Token embeddings [1, seq, dim] for ids [1, seq], each image's embeddings [n, dim] written
    over its slots."""
    x = embed(ids)
    for start, image in zip(image_starts, images, strict=True):
        x[0, start : start + image.shape[0]] = image.to(x.dtype)
    return x


# ---------------------------------------------------------------- an mmproj beside a model program


class Vision:
    """An mmproj file's encoder on a device, for one language model: pixels in, embeddings out."""

    def __init__(self, path: str, lm_dim: int, device: torch.device, dtype: torch.dtype, mode: str = "pad") -> None:
        from kernels.llama_q4k.mmproj import load_mmproj

        self.path, self.mode = path, mode
        self.args, weights = load_mmproj(path)
        if self.args.projection_dim != lm_dim:
            raise ValueError(
                f"{path}: the projector makes {self.args.projection_dim}-wide embeddings; "
                f"the language model's are {lm_dim}: not this model's mmproj"
            )
        ops = VISION_KERNEL_OPS if device.type == "cuda" else VISION_TORCH_OPS
        self.encoder = VisionEncoder(self.args, weights, device=device, dtype=dtype, ops=ops)
        self.weight_bytes = sum(w.numel() * w.element_size() for w in self.encoder.w.values())

    @property
    def n_image_tokens(self) -> int:
        return self.args.n_image_tokens

    def pixels(self, image: Image) -> Tensor:
        return preprocess(image, self.args, self.mode)

    def encode(self, pixels: Sequence[Tensor]) -> list[Tensor]:
        """Each image's embeddings [n_image_tokens, lm_dim], all images in one batch."""
        if not pixels:
            return []
        return list(self.encoder(torch.stack(list(pixels))).unbind(0))
