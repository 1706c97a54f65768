"""The Qwen3-VL TensorRT-LLM engine on a GPU (NGC container nvcr.io/nvidia/tritonserver:
26.07-trtllm-python-py3): engine builds of the tiny checkpoint, and greedy tokens of the engine
run through the stock C++ runtime (ModelRunnerCpp) equal to the PyTorch reference decoder's on
the same inputs: input_ids with fake ids, a prompt table with DeepStack rows and the
interleaved MRoPE table, all made by qvl_trt.mm. Run: scripts/verify_gpu.sh.

A float32 engine is compared with the float32 reference: equal greedy tokens, and logits of
every prompt position and generated step within TF32 rounding. The shipped FP16 engine is
compared on the first generated step (fp16 rounding may flip near-ties later on in a
random-weight model).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from gpu_tiers import trtllm_gpu_marks
from PIL import Image
from small_profile import small_profile_toml

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.llm.convert import convert_checkpoint
from qvl_trt.llm.engine import build_engines, engine_build_config
from qvl_trt.llm.reference import ReferenceDecoder
from qvl_trt.llm.sampling import DecodeRequest, SamplingParams
from qvl_trt.mm.chat import user_message
from qvl_trt.mm.prompt_table import assemble_prompt_table
from qvl_trt.mm.request import RequestLimits, RequestPreprocessor
from qvl_trt.profiles import load_profile

torch = pytest.importorskip("torch")
pytestmark = trtllm_gpu_marks("TensorRT-LLM 1.2 and a GPU")

MAX_TOKENS = 32
END_ID = 151645  # <|im_end|>
# Prompt text and image sizes (height, width) of the four requests.
CASES = {
    "text": ("Write a short poem about the sea.", []),
    "one_image": ("What is in this picture?", [(96, 128)]),
    "two_images": ("Compare the two pictures.", [(64, 64), (128, 96)]),
    "square_image": ("Describe it in one word.", [(128, 128)]),
}


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny-gpu.toml"
    path.write_text(small_profile_toml(
        compute_capability="9.0", trt_edition="tensorrt", max_batch_size=4,
        max_input_len=512, max_seq_len=640, max_num_tokens=2048,
        kv_cache_free_gpu_mem_fraction=0.3))
    return load_profile(str(path))


@pytest.fixture(scope="module")
def built(tiny_ckpt, profile, tmp_path_factory):
    """dtype -> (converted checkpoint, engine folder) for float32 and float16."""
    root = tmp_path_factory.mktemp("engines")
    k = open_checkpoint(tiny_ckpt).vision.deepstack_count
    out = {}
    for dtype in ("float32", "float16"):
        ckpt = convert_checkpoint(tiny_ckpt, root / f"ckpt-{dtype}",
                                  max_seq_len=profile.limits.max_seq_len, dtype=dtype).out
        work = root / f"llm-{dtype}"
        work.mkdir()
        config = engine_build_config(profile, deepstack_layers=k, dtype=dtype)
        # The fp32 check engine also returns the logits of every prompt position.
        config["gather_context_logits"] = dtype == "float32"
        build = build_engines(ckpt, work, config)
        out[dtype] = (ckpt, build.engine_dir)
    return out


@pytest.fixture(scope="module")
def requests(tiny_ckpt, profile):
    """name -> DecodeRequest: inputs from qvl_trt.mm, visual features seeded random (the
    engine and the reference decoder only see the prompt table; the vision engine has its
    own tests)."""
    ckpt = open_checkpoint(tiny_ckpt)
    pre = RequestPreprocessor.from_checkpoint(tiny_ckpt, RequestLimits.from_profile(profile))
    scale = float(ckpt.load("model.language_model.embed_tokens.weight").float().std())
    rng = np.random.default_rng(0)
    out = {}
    for name, (prompt, sizes) in CASES.items():
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                  for h, w in sizes]
        prepared = pre.prepare(messages=user_message(prompt, len(images)), images=images)
        visual = sum(prepared.image_token_counts)
        table = None
        if visual:
            hidden = ckpt.text.hidden_size
            main, *deepstack = (rng.normal(0, scale, (visual, hidden)).astype(np.float32)
                                for _ in range(1 + ckpt.vision.deepstack_count))
            table = assemble_prompt_table(main, deepstack)
        out[name] = DecodeRequest(
            input_ids=tuple(int(t) for t in prepared.engine_input_ids),
            mrope_rotary_cos_sin=prepared.mrope_rotary_cos_sin,
            mrope_position_delta=prepared.mrope_position_delta,
            prompt_table=table,
            sampling=SamplingParams(max_tokens=MAX_TOKENS, greedy=True,
                                    stop_token_ids=(END_ID,)))
    return out


def _run_engine(engine_dir, batch: list[DecodeRequest]) -> list[dict]:
    """One ModelRunnerCpp generate call for the batch: per request its greedy tokens, its
    context logits (when the engine gathers them) and its generation logits (fp32 CPU)."""
    from tensorrt_llm.layers import MropeParams
    from tensorrt_llm.runtime import ModelRunnerCpp

    import qvl_trt.llm.network  # noqa: F401  (registers the architecture EngineConfig reads)

    runner = ModelRunnerCpp.from_dir(str(engine_dir), rank=0, gather_generation_logits=True,
                                     kv_cache_free_gpu_memory_fraction=0.3)
    try:
        tables = [r.prompt_table for r in batch]
        rows = max((t.shape[0] for t in tables if t is not None), default=0)
        prompt_table = prompt_tasks = None
        if rows:  # one [rows, hidden] table per request, zeros where a request has none
            hidden = next(t for t in tables if t is not None).shape[1]
            stacked = np.zeros((len(batch), rows, hidden), np.float32)
            for b, table in enumerate(tables):
                if table is not None:
                    stacked[b, : table.shape[0]] = table
            prompt_table = torch.from_numpy(stacked)
            prompt_tasks = ",".join(str(b) for b in range(len(batch)))
        mrope = MropeParams(
            mrope_rotary_cos_sin=torch.from_numpy(
                np.stack([np.asarray(r.mrope_rotary_cos_sin, np.float32) for r in batch])),
            mrope_position_deltas=torch.tensor([[r.mrope_position_delta] for r in batch],
                                               dtype=torch.int32))
        inputs = [torch.tensor(r.input_ids, dtype=torch.int32) for r in batch]
        out = runner.generate(inputs, max_new_tokens=MAX_TOKENS, end_id=END_ID, pad_id=END_ID,
                              top_k=1, prompt_table=prompt_table, prompt_tasks=prompt_tasks,
                              mrope_params=mrope, return_dict=True,
                              output_sequence_lengths=True, output_generation_logits=True)
        vocab = runner.vocab_size
        results = []
        for b, ids in enumerate(inputs):
            tokens = out["output_ids"][b, 0, len(ids): int(out["sequence_lengths"][b, 0])]
            context = out.get("context_logits")
            results.append({
                "tokens": tokens.tolist(),
                "context_logits": None if context is None
                else context[b, : len(ids), :vocab].float().cpu(),
                "generation_logits": out["generation_logits"][b, 0, : len(tokens), :vocab]
                .float().cpu(),
            })
        return results
    finally:
        runner.session.shutdown()


def _run_reference(ckpt, batch: list[DecodeRequest]) -> list[dict]:
    decoder = ReferenceDecoder.load(ckpt, device="cuda", dtype="float32")
    batch = [replace(r, return_context_logits=True, return_generation_logits=True)
             for r in batch]
    return [{"tokens": list(r.token_ids), "context_logits": r.context_logits.float().cpu(),
             "generation_logits": r.generation_logits.float().cpu()}
            for r in decoder.generate(batch)]


def _strip_end(tokens: list[int]) -> list[int]:
    """Whether the runtime returns the end id itself is its business; compare without it."""
    return tokens[:-1] if tokens and tokens[-1] == END_ID else tokens


def _max_diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def test_fp16_engine_folder(built, profile):
    _, engine_dir = built["float16"]
    config = json.loads((engine_dir / "config.json").read_text())
    build, pretrained = config["build_config"], config["pretrained_config"]
    assert build["use_mrope"] is True
    assert build["max_prompt_embedding_table_size"] == 4 * 4 * 128
    assert build["plugin_config"]["gemm_plugin"] == "float16"
    assert build["plugin_config"]["gpt_attention_plugin"] == "float16"
    assert build["plugin_config"]["paged_kv_cache"] is True
    assert pretrained["architecture"] == "Qwen3VLForCausalLM"
    assert pretrained["max_position_embeddings"] == profile.limits.max_seq_len
    assert pretrained["num_deepstack_layers"] == 3
    assert (engine_dir / "rank0.engine").stat().st_size > 0
    assert (engine_dir.parent / "reproduce.sh").is_file()


@pytest.mark.parametrize("name", ["text", "one_image", "two_images"])
def test_single_request_tokens_equal_the_reference(built, requests, name):
    ckpt, engine_dir = built["float32"]
    engine = _run_engine(engine_dir, [requests[name]])[0]
    reference = _run_reference(ckpt, [requests[name]])[0]
    assert _strip_end(engine["tokens"]) == _strip_end(reference["tokens"])


def test_batch_of_four_mixed_requests_equals_the_reference(built, requests):
    """Tokens equal; logits of every prompt position (DeepStack and MRoPE act there) and of
    every generated step (plain RoPE at position + delta) within TF32 rounding. Dropping the
    DeepStack rows moves these logits by ~0.7 (logits peak near 1)."""
    ckpt, engine_dir = built["float32"]
    batch = [requests[name] for name in CASES]
    engine, reference = _run_engine(engine_dir, batch), _run_reference(ckpt, batch)
    for name, got, want in zip(CASES, engine, reference, strict=True):
        assert _strip_end(got["tokens"]) == _strip_end(want["tokens"]), name
        assert _max_diff(got["context_logits"], want["context_logits"]) <= 1e-2, name
        steps = len(got["tokens"])
        assert _max_diff(got["generation_logits"],
                         want["generation_logits"][:steps]) <= 1e-2, name


def test_fp16_engine_matches_the_reference(built, requests):
    """The shipped FP16 build: logits of the first generated step within fp16 rounding of the
    fp32 reference, and the same first token (later fp16 steps may flip near-ties)."""
    batch = [requests[name] for name in CASES]
    engine = _run_engine(built["float16"][1], batch)
    reference = _run_reference(built["float32"][0], batch)
    for name, got, want in zip(CASES, engine, reference, strict=True):
        assert got["tokens"][:1] == want["tokens"][:1], name
        assert _max_diff(got["generation_logits"][:1],
                         want["generation_logits"][:1]) <= 5e-2, name


def test_tensor_parallel_build_writes_every_rank(tiny_ckpt, profile, tmp_path):
    ckpt = convert_checkpoint(tiny_ckpt, tmp_path / "ckpt", max_seq_len=profile.limits.max_seq_len,
                              tp_size=2).out
    work = tmp_path / "llm"
    work.mkdir()
    build = build_engines(ckpt, work, engine_build_config(profile, deepstack_layers=3))
    assert build.tp_size == 2
    assert sorted(p.name for p in build.engine_dir.glob("rank*.engine")) == [
        "rank0.engine", "rank1.engine"]
    config = json.loads((build.engine_dir / "config.json").read_text())
    assert config["pretrained_config"]["mapping"]["tp_size"] == 2
