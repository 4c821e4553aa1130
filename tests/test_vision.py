"""Image input for model programs: an mmproj GGUF written by our writer, preprocessing against
transformers' CLIP image processor, the vision tower and projector against transformers' CLIP
and LLaVA modules with the same weights, and images through the real server with `openai`.

The Triton kernels' run of the encoder happens in a child process (TRITON_INTERPRET=1 must be
set before triton is imported), which is this file run as a script.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
np = pytest.importorskip("numpy")
PIL_Image = pytest.importorskip("PIL.Image")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script by the interpreter test
    sys.path.insert(0, str(ROOT))

from kernels.llama_q4k.mmproj import VisionArgs, from_transformers, load_mmproj, write_mmproj  # noqa: E402
from kernels.llama_q4k.vision import (  # noqa: E402
    IMAGE_MARKER,
    VISION_KERNEL_OPS,
    VISION_TORCH_OPS,
    VisionEncoder,
    image_from_data_url,
    pad_to_square,
    preprocess,
    tokenize,
)

VOCAB = ROOT / "tests" / "fixtures" / "gguf" / "ggml-vocab-phi-3.gguf"
HF_ACT = {"quick": "quick_gelu", "erf": "gelu"}


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    image = PIL_Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return image.convert(mode)


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# ---------------------------------------------------------------- preprocessing


def llava_expand_to_square(image, mean):
    """LLaVA's own expand2square, written out as its repository does it."""
    width, height = image.size
    color = tuple(int(x * 255) for x in mean)
    if width == height:
        return image
    if width > height:
        result = PIL_Image.new(image.mode, (width, width), color)
        result.paste(image, (0, (width - height) // 2))
    else:
        result = PIL_Image.new(image.mode, (height, height), color)
        result.paste(image, ((height - width) // 2, 0))
    return result


@pytest.mark.parametrize("size", [(640, 480), (300, 500), (336, 336), (1000, 37), (17, 23)])
@pytest.mark.parametrize("mode", ["pad", "crop"])
def test_preprocessing_is_bit_for_bit_transformers_clip_processor(size, mode):
    from transformers import CLIPImageProcessorPil

    args = VisionArgs(image_size=336, patch_size=14, dim=64, ffn_dim=128, n_layers=1, n_heads=4, projection_dim=64)
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
        image_mean=list(args.image_mean), image_std=list(args.image_std),
    )
    for image_mode in ("RGB", "RGBA", "L"):
        image = random_image(*size, seed=sum(size), mode=image_mode)
        ours = preprocess(image, args, mode)
        source = image.convert("RGB")
        if mode == "pad":
            source = llava_expand_to_square(source, processor.image_mean)
        expected = processor(images=source, return_tensors="pt")["pixel_values"][0]
        assert ours.dtype == expected.dtype == torch.float32
        assert torch.equal(ours, expected), (size, mode, image_mode, (ours - expected).abs().max())


def test_pad_to_square_centres_the_image_on_the_mean_colour():
    image = PIL_Image.new("RGB", (4, 2), (255, 255, 255))
    square = np.asarray(pad_to_square(image, (0.5, 0.25, 0.0)))
    assert square.shape == (4, 4, 3)
    assert square[0, 0].tolist() == [127, 63, 0] and square[3, 3].tolist() == [127, 63, 0]
    assert (square[1:3] == 255).all()


# ---------------------------------------------------------------- the encoder against transformers


def tiny_tower(activation: str, seed: int = 0, layers: int = 3):
    """A transformers CLIP vision tower and LLaVA projector with random weights, matrices rounded
    to fp16 (what an mmproj file stores), so both sides start from the same numbers."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    torch.manual_seed(seed)
    config = CLIPVisionConfig(image_size=56, patch_size=14, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_hidden_layers=layers, hidden_act=HF_ACT[activation])
    tower = CLIPVisionModel(config).eval()
    llava = LlavaConfig(vision_config=config, text_config=LlamaConfig(hidden_size=256),
                        projector_hidden_act="gelu", vision_feature_layer=-2)
    projector = LlavaMultiModalProjector(llava).eval()
    with torch.no_grad():
        for p in [*tower.parameters(), *projector.parameters()]:
            p.add_(0.05 * torch.randn_like(p))
            if p.dim() >= 2:
                p.copy_(p.half().float())
    # LLaVA's converter keeps the layers up to the second-to-last one's output.
    args = VisionArgs(image_size=56, patch_size=14, dim=64, ffn_dim=128, n_layers=layers - 1, n_heads=4,
                      projection_dim=256, activation=activation)
    weights = from_transformers(tower.state_dict(), projector.state_dict(), layers - 1)
    return tower, projector, args, weights


def errors_against_transformers(path: Path, tower, projector, ops) -> dict:
    """Per-layer and final max abs error of our encoder (loaded from `path`) against transformers."""
    args, weights = load_mmproj(path)
    encoder = VisionEncoder(args, weights, ops=ops)
    pixels = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = tower(pixel_values=pixels, output_hidden_states=True).hidden_states
        expected = projector(hidden[-2][:, 1:])
    layers: list = []
    ours = encoder(pixels, layers)
    return {
        "layers": [float((a - b).abs().max()) for a, b in zip(layers, hidden, strict=False)],
        "final": float((ours - expected).abs().max()),
        "scale": float(expected.abs().max()),
        "shape": list(ours.shape),
    }


@pytest.mark.parametrize("activation", ["quick", "erf"])
def test_encoder_matches_transformers_clip_and_llava_projector(tmp_path, activation):
    tower, projector, args, weights = tiny_tower(activation)
    path = write_mmproj(tmp_path / "mmproj.gguf", args, weights)
    loaded_args, _ = load_mmproj(path)
    assert loaded_args.n_layers == 2 and loaded_args.activation == activation and loaded_args.n_image_tokens == 16
    errors = errors_against_transformers(path, tower, projector, VISION_TORCH_OPS)
    assert errors["shape"] == [2, 16, 256]
    assert len(errors["layers"]) == 3  # the embeddings, then each stored layer
    assert max(errors["layers"]) < 1e-4, errors
    assert errors["final"] < 1e-4 * max(1.0, errors["scale"]), errors


def test_older_files_with_swapped_ffn_names_load_the_same(tmp_path):
    tower, projector, args, weights = tiny_tower("quick")
    right = write_mmproj(tmp_path / "right.gguf", args, weights)
    # Older converters wrote CLIP's fc1 as ffn_down and fc2 as ffn_up.
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(str(right))
    writer = GGUFWriter(str(tmp_path / "swapped.gguf"), arch="clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if isinstance(value, bool):
            writer.add_bool(field.name, value)
        elif isinstance(value, str):
            writer.add_string(field.name, value)
        elif isinstance(value, list):
            writer.add_array(field.name, value)
        elif isinstance(value, float):
            writer.add_float32(field.name, value)
        else:
            writer.add_uint32(field.name, int(value))
    for tensor in reader.tensors:
        name = tensor.name.replace("ffn_up", "@").replace("ffn_down", "ffn_up").replace("@", "ffn_down")
        writer.add_tensor(name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    a = errors_against_transformers(right, tower, projector, VISION_TORCH_OPS)
    b = errors_against_transformers(tmp_path / "swapped.gguf", tower, projector, VISION_TORCH_OPS)
    assert a == b and a["final"] < 1e-4


def test_what_is_not_covered_is_refused_by_name(tmp_path):
    from gguf import GGUFWriter

    from kernels.llama_q4k.weights import write_tiny_model

    lm = write_tiny_model(tmp_path / "lm.gguf", "llama", VOCAB)
    with pytest.raises(ValueError, match="not an mmproj file"):
        load_mmproj(lm)
    _, _, args, weights = tiny_tower("quick")
    path = write_mmproj(tmp_path / "mm.gguf", args, weights)
    for key, value, message in [
        ("clip.vision.projector_type", "ldp", "projector type 'ldp'"),
        ("clip.vision.image_grid_pinpoints", [336, 672, 672, 336], "anyres"),
    ]:
        writer = GGUFWriter(str(tmp_path / "bad.gguf"), arch="clip")
        for field in ("clip.vision.image_size", "clip.vision.patch_size"):
            writer.add_uint32(field, 56 if field.endswith("image_size") else 14)
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_string(key, value)
        writer.add_tensor("v.class_embd", np.zeros(4, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ValueError, match=message):
            load_mmproj(tmp_path / "bad.gguf")
    from kernels.llama_q4k.vision import Vision

    with pytest.raises(ValueError, match="not this model's mmproj"):
        Vision(str(path), 512, torch.device("cpu"), torch.float32)


def interpreted_errors(directory: str) -> dict:
    """The kernels' encoder against transformers (run in the child, under the interpreter)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    report = {}
    for activation in ("quick", "erf"):
        tower, projector, args, weights = tiny_tower(activation)
        path = write_mmproj(Path(directory) / f"{activation}.gguf", args, weights)
        report[activation] = errors_against_transformers(path, tower, projector, VISION_KERNEL_OPS)
    return report


@pytest.mark.slow
def test_encoder_on_the_triton_kernels_matches_transformers(tmp_path):
    child = subprocess.run(
        [sys.executable, __file__, str(tmp_path)],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.splitlines()[-1])
    for activation, errors in report.items():
        assert max(errors["layers"]) < 1e-4 and errors["final"] < 1e-4, (activation, errors)


@pytest.mark.slow
def test_layernorm_and_gelu_kernels_check_themselves_under_the_interpreter():
    for module in ("kernels.layernorm.layernorm", "kernels.gelu.gelu"):
        child = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True,
                               env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
        assert child.returncode == 0 and ": ok" in child.stdout, child.stderr[-3000:]


# ---------------------------------------------------------------- prompts with images


def test_markers_become_slots_and_data_urls_decode():
    def encode(text, add_special=True, **_):
        return ([1] if add_special else []) + [ord(c) for c in text]

    marked = tokenize(encode, f"ab{IMAGE_MARKER}c{IMAGE_MARKER}", 3, 2)
    assert marked.ids == [1, 97, 98, 0, 0, 0, 99, 0, 0, 0]
    assert marked.image_starts == [3, 7]
    from kernels.llama_q4k.vision import text_ids

    assert text_ids(marked.ids, marked.image_starts, 3) == [1, 97, 98, 99]
    with pytest.raises(ValueError, match="marks 1 image"):
        tokenize(encode, f"a{IMAGE_MARKER}", 3, 2)
    image = random_image(5, 3)
    assert np.array_equal(np.asarray(image_from_data_url(data_url(image))), np.asarray(image))
    # A 16000x1 PNG is a few hundred bytes, but padded to a square it is 768 MB of pixels.
    for size, message in [((16000, 1), "a side"), ((300, 10), "more than 20:1"), ((9000, 500), "a side")]:
        with pytest.raises(ValueError, match=message):
            image_from_data_url(data_url(PIL_Image.new("RGB", size)))
    for bad, message in [("https://example.com/cat.png", "fetches nothing"),
                         ("data:image/png,abc", "base64"),
                         ("data:image/png;base64,%%%", "does not decode"),
                         ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a readable image")]:
        with pytest.raises(ValueError, match=message):
            image_from_data_url(bad)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path]:
    from kernels.llama_q4k.weights import write_tiny_model

    directory = tmp_path_factory.mktemp("vision")
    lm = write_tiny_model(directory / "tiny.gguf", "llama", VOCAB)
    _, _, args, weights = tiny_tower("quick")
    return lm, write_mmproj(directory / "mmproj.gguf", args, weights)


@pytest.mark.slow
def test_an_image_request_round_trips_through_the_openai_client(files):
    openai = pytest.importorskip("openai")
    from kernels.llama_q4k.chat import TextModel
    from kernels.llama_q4k.sampling import SamplingParams

    from .test_serve import _start

    lm, mmproj = files
    red, noise = PIL_Image.new("RGB", (40, 30), (200, 30, 30)), random_image(64, 48, seed=3)
    solo = TextModel(str(lm), "cpu", max_seq=160, mmproj=str(mmproj))
    greedy = SamplingParams()
    expected = {
        name: solo.chat([{"role": "user", "content": "What is in the picture?"}], greedy, 12, images=[image]).tokens
        for name, image in (("red", red), ("noise", noise))
    }
    assert expected["red"] != expected["noise"]  # the reply depends on the image
    proc, url = _start(lm, "--memory-budget", "64MiB", "--max-batch", "2", "--max-context", "160",
                       "--mmproj", str(mmproj))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        for name, image in (("red", red), ("noise", noise)):
            reply = client.chat.completions.create(
                model="tiny.gguf", max_tokens=12, temperature=0,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": "\nWhat is in the picture?"},
                ]}],
            )
            assert reply.choices[0].message.content == solo.tokenizer.decode(expected[name]), name
            assert reply.usage.prompt_tokens > 16  # the image's 16 slots and the text
            timings = reply.model_extra["timings"]
            assert timings["image_encode_ms"] > 0 and timings["prefill_ms"] >= 0
        with pytest.raises(openai.BadRequestError, match="fetches nothing"):
            client.chat.completions.create(model="tiny.gguf", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
        # ten images of 16 tokens fill a 160-token context: refused before any is decoded
        with pytest.raises(openai.BadRequestError, match="do not fit"):
            client.chat.completions.create(model="tiny.gguf", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(red)}}] * 10}])
        with pytest.raises(openai.BadRequestError, match="sides more than"):
            client.chat.completions.create(model="tiny.gguf", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(PIL_Image.new("RGB", (4000, 2)))}}]}])
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert "loom_serve_images_total 2" in metrics and "loom_serve_image_encode_seconds" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    proc, url = _start(lm, "--memory-budget", "64MiB", "--max-batch", "2", "--max-context", "160")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        with pytest.raises(openai.BadRequestError, match="no vision encoder"):
            client.chat.completions.create(model="tiny.gguf", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(red)}}]}])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_prompt_embeddings_without_images_are_the_token_embeddings(files):
    from kernels.llama_q4k.weights import build_model, load_gguf

    lm, _ = files
    args, weights, _ = load_gguf(lm)
    model = build_model(args, weights, device="cpu", dtype=torch.float32)
    model.setup_caches(1, 32)
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    positions = torch.arange(5)
    with torch.inference_mode():
        plain = model(ids, positions)
        spliced = model(ids, positions, embeds=model.tok_embeddings(ids))
        image = torch.randn(2, args.dim)
        embeds = model.tok_embeddings(ids).clone()
        embeds[0, 1:3] = image
        changed = model(ids, positions, embeds=embeds)
    assert torch.equal(plain, spliced)
    assert torch.equal(changed[:, 0], plain[:, 0]) and not torch.allclose(changed[:, 1:], plain[:, 1:])


@pytest.mark.slow
def test_llamacpp_reads_our_mmproj_as_we_mean_it(tmp_path):
    """llama.cpp's mtmd on a file of our writer gives our weights' embeddings run its own way
    (one layer fewer, class token last: benchmarks/vision_vs_llamacpp.py). Skips where the
    llama-cpp-python binding is not installed (CI; `../shared/device/llamacpp.md` builds it)."""
    pytest.importorskip("llama_cpp.mtmd_cpp")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vision_vs_llamacpp import compare, tiny_mmproj

    from kernels.llama_q4k.weights import write_tiny_model

    lm = write_tiny_model(tmp_path / "lm.gguf", "llama", VOCAB, dense=True)
    result = compare(lm, tiny_mmproj(tmp_path / "mmproj.gguf"))
    assert result["tokens"] == [16, 256]
    # llama.cpp keeps the patch kernel and matmuls in fp16: a few 1e-4 of the largest value
    assert result["llamacpp_graph_vs_llamacpp_max_abs"] < 2e-3 * result["largest_embedding"], result


@pytest.mark.gpu
def test_encoder_on_gpu_kernels_matches_its_torch_path(files):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU; none visible")
    _, mmproj = files
    args, weights = load_mmproj(mmproj)
    pixels = torch.randn(3, 3, 56, 56)
    ours = VisionEncoder(args, weights, "cuda", torch.float32, VISION_KERNEL_OPS)(pixels)
    plain = VisionEncoder(args, weights, "cuda", torch.float32, VISION_TORCH_OPS)(pixels)
    torch.testing.assert_close(ours, plain, atol=1e-4, rtol=1e-4)


if __name__ == "__main__":
    print(json.dumps(interpreted_errors(sys.argv[1])))


def test_the_kernels_refuse_weights_of_the_wrong_shape():
    from kernels.gelu.gelu import bias_gelu
    from kernels.layernorm.layernorm import add_layer_norm

    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight and bias must be"):
        add_layer_norm(x, None, torch.ones(16)[::2].clone()[:4], torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="delta must have"):
        add_layer_norm(x, torch.randn(1, 8), torch.ones(8), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="bias must be"):
        bias_gelu(x, torch.zeros(4), "erf")
    total, normed = add_layer_norm(x, x, torch.ones(16)[::2], torch.zeros(8), 1e-5)  # strided weight
    expected = torch.nn.functional.layer_norm(2 * x, (8,), eps=1e-5)
    torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)
