"""The in-process reference pipeline (qvl_trt.mm -> vision tower -> prompt table -> reference
decoder) and `qvl-trt generate`, against Hugging Face fed by its own image processor and chat
template."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from qvl_trt.cli import app
from qvl_trt.errors import CheckpointError, InputError
from qvl_trt.llm.pipeline import ReferencePipeline, sampling_params
from qvl_trt.llm.sampling import FinishReason, SamplingParams

PROMPT = "What is in the pictures?"
TOKENS = 16


def _png(height: int, width: int, seed: int, fmt: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


IMAGES = [_png(100, 150, 1, "PNG"), _png(300, 420, 2, "PNG")]


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt: Path) -> ReferencePipeline:
    return ReferencePipeline.load(tiny_ckpt, max_seq_len=1024)


@pytest.fixture(scope="module")
def hf_run(tiny_ckpt: Path, tiny_hf_model):
    """HF greedy tokens and prompt logits, inputs built by HF's image processor and template."""
    import transformers

    model = tiny_hf_model
    # The PIL backend, which qvl_trt.mm reproduces (tests/test_mm_pixels.py): where torchvision
    # is installed transformers picks its torchvision backend, whose resize differs slightly
    # (prompt logits 1e-3 apart on the tiny model, against the 1e-4 below).
    processor = transformers.AutoImageProcessor.from_pretrained(str(tiny_ckpt), backend="pil")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_ckpt))
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in IMAGES]
    pixels = processor(images=images, return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": PROMPT}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for grid in pixels["image_grid_thw"]:  # what the HF processor does to the text
        text = text.replace("<|image_pad|>", "<|placeholder|>" * int(grid.prod() // 4), 1)
    ids = tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"), return_tensors="pt")
    inputs = {"input_ids": ids["input_ids"], "pixel_values": pixels["pixel_values"],
              "image_grid_thw": pixels["image_grid_thw"],
              "mm_token_type_ids": (ids["input_ids"] == 151655).int()}
    with torch.no_grad():
        logits = model(**inputs).logits[0]
        tokens = model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return inputs["input_ids"][0], tokens[0, inputs["input_ids"].shape[1]:], logits


def test_pipeline_matches_hf(pipeline: ReferencePipeline, hf_run) -> None:
    hf_ids, hf_tokens, hf_logits = hf_run
    greedy = SamplingParams(max_tokens=TOKENS, greedy=True, stop_token_ids=(10**5,))
    prepared, request = pipeline.prepare(
        [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                      {"type": "text", "text": PROMPT}]}], IMAGES,
        sampling=greedy)
    assert prepared.input_ids.tolist() == hf_ids.tolist()
    result = pipeline.decoder.generate([dataclasses.replace(
        request, return_context_logits=True)])[0]
    difference = (result.context_logits - hf_logits).abs().max().item()
    assert difference <= 1e-4, f"prompt logits differ from HF by {difference:.2e}"
    answer = pipeline.ask(PROMPT, IMAGES, sampling=greedy)
    assert list(answer.token_ids) == hf_tokens.tolist()
    assert answer.image_tokens == 70 + 117 and answer.prompt_tokens == len(hf_ids)
    assert answer.text == pipeline.preprocessor.prompts.tokenizer.decode(hf_tokens)


@pytest.mark.parametrize(("seed", "tokens"), [(4, 10), (48, 8)])
def test_streamed_text_adds_up(pipeline: ReferencePipeline, seed: int, tokens: int) -> None:
    """The stream (the served postprocessing's StreamDecoder) adds up to the one-shot decode,
    also when the answer ends inside a character (seed 48: a lone byte, U+FFFD at the end,
    which the old prefix re-decoding dropped from the stream)."""
    deltas = []
    answer = pipeline.ask("Hello", sampling=SamplingParams(max_tokens=tokens, seed=seed),
                          on_text=deltas.append)
    assert [d.token_id for d in deltas] == list(answer.token_ids)
    assert "".join(d.text for d in deltas) == answer.text
    tokenizer = pipeline.preprocessor.prompts.tokenizer
    assert answer.text == tokenizer.decode(list(answer.token_ids), skip_special_tokens=True)
    assert answer.text.endswith("\ufffd") == (seed == 48)


def test_stop_ids_and_sampling_defaults(pipeline: ReferencePipeline, tiny_ckpt: Path) -> None:
    assert pipeline.stop_token_ids == (151645, 151643)  # generation_config.json's eos ids
    _, request = pipeline.prepare([{"role": "user", "content": "Hi"}])
    assert request.sampling.stop_token_ids == (151645, 151643)
    defaults = sampling_params(tiny_ckpt, max_tokens=5)
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.7, 20, 0.8)
    assert sampling_params(tiny_ckpt, max_tokens=5, top_k=3).top_k == 3
    assert sampling_params(tiny_ckpt, max_tokens=5, greedy=True).is_greedy
    with pytest.raises(InputError, match="--greedy takes no --temperature"):
        sampling_params(tiny_ckpt, max_tokens=5, greedy=True, temperature=0.5)


def test_given_checkpoint_must_come_from_the_model(tiny_ckpt: Path, tmp_path) -> None:
    from qvl_trt.llm.convert import convert_checkpoint

    out = convert_checkpoint(tiny_ckpt, tmp_path / "llm", max_seq_len=256, dtype="float32").out
    ReferencePipeline.load(tiny_ckpt, checkpoint=out)  # loads
    other = tmp_path / "other"
    shutil.copytree(out, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="was not converted from"):
        ReferencePipeline.load(tiny_ckpt, checkpoint=other)


def test_cli_generate(tiny_ckpt: Path, pipeline: ReferencePipeline, tmp_path) -> None:
    files = []
    for i, data in enumerate(IMAGES):
        files += ["--image", str(tmp_path / f"{i}.png")]
        (tmp_path / f"{i}.png").write_bytes(data)
    runner = CliRunner()
    base = ["generate", "--model", str(tiny_ckpt), "--prompt", PROMPT, "--max-tokens", "6",
            "--max-seq-len", "1024"]
    result = runner.invoke(app, base + files + ["--greedy", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    expected = pipeline.ask(PROMPT, IMAGES, sampling=SamplingParams(max_tokens=6, greedy=True))
    assert summary["token_ids"] == list(expected.token_ids)
    assert summary["finish_reason"] == FinishReason.LENGTH.value
    assert (summary["image_tokens"], summary["completion_tokens"]) == (187, 6)

    streamed = runner.invoke(app, base + ["--seed", "1", "--stream", "--json"])
    assert streamed.exit_code == 0, streamed.output
    lines = [json.loads(line) for line in streamed.stdout.strip().splitlines()]
    assert [line["token_id"] for line in lines[:-1]] == lines[-1]["token_ids"]

    plain = runner.invoke(app, base + ["--greedy"])
    assert plain.exit_code == 0 and "6 tokens (length)" in plain.stdout

    for args, message in ((["--image", str(tmp_path / "missing.png")], "no such file"),
                          (["--greedy", "--top-p", "0.5"], "--greedy takes no")):
        bad = runner.invoke(app, base + args)
        assert bad.exit_code == 1 and message in bad.output
        assert len(bad.output.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: run scripts/verify_gpu.sh on a GPU machine")
@pytest.mark.parametrize("images", [[], IMAGES[:1], IMAGES], ids=["text", "one", "two"])
def test_pipeline_on_cuda_gives_the_cpu_tokens(pipeline: ReferencePipeline, tiny_ckpt: Path,
                                               images) -> None:
    """The whole pipeline (vision tower, prompt table, decoder) on CUDA: fp32 greedy tokens
    equal the CPU pipeline's; fp16 is only required to agree on the first token (random
    weights leave near-ties later)."""
    greedy = SamplingParams(max_tokens=32, greedy=True)
    expected = pipeline.ask(PROMPT, images, sampling=greedy).token_ids
    for dtype in ("float32", "float16"):
        cuda = ReferencePipeline.load(tiny_ckpt, device="cuda", dtype=dtype, max_seq_len=1024)
        got = cuda.ask(PROMPT, images, sampling=greedy).token_ids
        assert got == expected if dtype == "float32" else got[0] == expected[0], dtype


# ---- videos: the same pixels through Hugging Face ---------------------------------------------

def _video_cases():
    from video_clips import png_frames, video_file

    from qvl_trt.chat_messages import VideoFile, VideoFrames

    clip = VideoFile(video_file(30, 96, 64, rate=10))  # 3 s at 2 fps: 6 frames, 3 groups
    frames = VideoFrames(png_frames(5, 64, 64, seed=2), fps=1.0)  # 3 groups, the last repeats
    return {"video": ([], [clip]), "video+image": (IMAGES[:1], [clip]),
            "two videos": ([], [clip, frames])}


@pytest.mark.parametrize("case", ["video", "video+image", "two videos"])
def test_pipeline_matches_hf_on_videos(pipeline: ReferencePipeline, tiny_hf_model,
                                       case: str) -> None:
    """Our preprocessing's pixels and ids go to HF generate as pixel_values_videos /
    video_grid_thw (and pixel_values / image_grid_thw): the reference pipeline (one tower call
    per temporal group, the prompt table, the MRoPE table) gives HF's greedy tokens."""
    pytest.importorskip("av", reason="video files need PyAV: pip install 'qvl-trt[serve]'")
    images, videos = _video_cases()[case]
    greedy = SamplingParams(max_tokens=TOKENS, greedy=True, stop_token_ids=(10**5,))
    messages = [{"role": "user", "content": [{"type": "video"}] * len(videos[:1]) + [
        {"type": "image"}] * len(images) + [{"type": "video"}] * len(videos[1:]) + [
        {"type": "text", "text": "What happens in the videos?"}]}]
    prepared, request = pipeline.prepare(messages, images, sampling=greedy, videos=videos)
    inputs = _hf_inputs(prepared, pipeline.preprocessor.pixels)
    with torch.no_grad():
        hf_logits = tiny_hf_model(**inputs).logits[0]
        hf_tokens = tiny_hf_model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    hf_tokens = hf_tokens[0, prepared.num_tokens:].tolist()
    result = pipeline.decoder.generate([dataclasses.replace(
        request, return_context_logits=True)])[0]
    difference = (result.context_logits - hf_logits).abs().max().item()
    assert difference <= 1e-4, f"prompt logits differ from HF by {difference:.2e}"
    answer = pipeline.generate(messages, images, sampling=greedy, videos=videos)
    assert list(answer.token_ids) == hf_tokens
    groups = sum(len(v.groups) for v in prepared.videos)
    assert groups == (3 if case != "two videos" else 6)


def _hf_inputs(prepared, pixels) -> dict:
    """HF model inputs of a prepared request: its ids, and its vision items' normalised rows
    split into images and videos (HF's pixel_values_videos rows are ours, group after group)."""
    grouped = {id(g) for video in prepared.videos for g in video.groups}
    pictures = [item for item in prepared.images if id(item) not in grouped]
    ids = torch.from_numpy(prepared.input_ids.astype(np.int64))[None]
    inputs = {"input_ids": ids,
              "mm_token_type_ids": (ids == 151655).int() + 2 * (ids == 151656).int()}
    if pictures:
        inputs["pixel_values"] = torch.from_numpy(
            pixels.normalise(np.concatenate([p.pixel_values for p in pictures])))
        inputs["image_grid_thw"] = torch.tensor([p.grid_thw for p in pictures])
    inputs["pixel_values_videos"] = torch.from_numpy(pixels.normalise(np.concatenate(
        [g.pixel_values for video in prepared.videos for g in video.groups])))
    inputs["video_grid_thw"] = torch.tensor([video.grid_thw for video in prepared.videos])
    return inputs
