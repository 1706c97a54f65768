"""The Qwen3-VL TensorRT-LLM engine on a GPU (NGC container nvcr.io/nvidia/tritonserver:
26.07-trtllm-python-py3): engine builds of the tiny checkpoint, and the engine run through the
stock C++ runtime (ModelRunnerCpp) against the PyTorch reference decoder on the same inputs:
input_ids with fake ids, a prompt table with DeepStack rows and the interleaved MRoPE table,
all made by qvl_trt.mm. Run: scripts/verify_gpu.sh.

Weight-only INT8 / INT4 engines (float16, WeightOnlyQuantMatmul plugin; TensorRT-LLM's loader
quantizes and lays out the checkpoint's float16 linears) are compared the same way with the
reference decoder on the same checkpoint, which quantizes with qvl_trt's `quantize` and
dequantizes as the GEMM does (WEIGHT_ONLY_TOLERANCE); that `quantize` is checked against the
loader's op on this GPU, to the bit.

Engines are float16 and bfloat16, the only ones that place image tokens (MRoPE is read on the
fused context path alone; the build refuses float32). Each is compared with the float32
reference on the same converted checkpoint and on prompt tables rounded to the engine dtype:
logits of every prompt position (DeepStack and MRoPE act there) within TOLERANCE, greedy
tokens equal up to the first near-tie (the reference's logit for the engine's token within
2 x TOLERANCE of its best), generation logits within TOLERANCE up to that step. The float32
engine check of earlier versions is gone: such an engine can no longer be built (the rank
child refuses a float32 checkpoint too), and its unfused attention never read the MRoPE
table, so it only ever vouched for text.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from gpu_tiers import trtllm_gpu_marks
from PIL import Image

from qvl_trt.chat_messages import user_message
from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.dtypes import Dtype, WeightOnly
from qvl_trt.llm.convert import convert_checkpoint
from qvl_trt.llm.engine import build_engines, engine_build_config, prompt_table_rows
from qvl_trt.llm.reference import ReferenceDecoder
from qvl_trt.llm.sampling import DecodeRequest, SamplingParams
from qvl_trt.llm.weight_only import quantize
from qvl_trt.mm.prompt_table import assemble_prompt_table
from qvl_trt.mm.request import RequestLimits, RequestPreprocessor
from qvl_trt.plan import make_plan
from qvl_trt.profiles import load_profile
from qvl_trt.testing.small_profile import small_profile_toml
from qvl_trt.workload import Workload

torch = pytest.importorskip("torch")
pytestmark = trtllm_gpu_marks("TensorRT-LLM 1.2 and a GPU")

MAX_TOKENS = 32
END_ID = 151645  # <|im_end|>
# Max |logit difference| from the fp32 reference, per engine dtype. Measured on CPU, the
# reference decoder itself run in that dtype differs from fp32 by ~1e-3 (fp16) and ~8e-3
# (bf16) on these requests; the failures this must catch move prompt logits (which peak
# near 1) far more: dropping the DeepStack rows ~0.65, image tokens at 1-D positions (what
# unfused attention does) ~0.27.
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}
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


def _convert_and_build(tiny_ckpt, profile, root, name: str, *, dtype: str = "float16",
                       weights: str = "none"):
    """(converted checkpoint, engine folder) of the tiny checkpoint, built under `root`."""
    k = open_checkpoint(tiny_ckpt).vision.deepstack_count
    ckpt = convert_checkpoint(tiny_ckpt, root / f"ckpt-{name}", dtype=dtype, weights=weights,
                              max_seq_len=profile.limits.max_seq_len).out
    work = root / f"llm-{name}"
    work.mkdir()
    # Also return the logits of every prompt position.
    config = {**engine_build_config(profile, deepstack_layers=k, dtype=dtype, weights=weights),
              "gather_context_logits": True}
    return ckpt, build_engines(ckpt, work, config).engine_dir


@pytest.fixture(scope="module")
def built(tiny_ckpt, profile, tmp_path_factory):
    """dtype -> (converted checkpoint, engine folder), for each dtype of TOLERANCE."""
    root = tmp_path_factory.mktemp("engines")
    return {dtype: _convert_and_build(tiny_ckpt, profile, root, dtype, dtype=dtype)
            for dtype in TOLERANCE}


@pytest.fixture(scope="module")
def references(built):
    """dtype -> the fp32 reference decoder (CUDA) on that dtype's converted checkpoint."""
    return {dtype: ReferenceDecoder.load(ckpt, device="cuda", dtype="float32")
            for dtype, (ckpt, _) in built.items()}


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
        hidden, per_token = ckpt.text.hidden_size, 1 + ckpt.vision.deepstack_count
        # A text-only request gets one token's worth of zero rows, as the vision_encoder
        # step sends (qvl_trt.vision.step): every request carries a table.
        table = np.zeros((per_token, hidden), np.float32)
        if visual:
            main, *deepstack = (rng.normal(0, scale, (visual, hidden)).astype(np.float32)
                                for _ in range(per_token))
            table = assemble_prompt_table(main, deepstack)
        out[name] = DecodeRequest(
            input_ids=tuple(int(t) for t in prepared.engine_input_ids),
            mrope_rotary_cos_sin=prepared.mrope_rotary_cos_sin,
            mrope_position_delta=prepared.mrope_position_delta,
            prompt_table=table,
            sampling=SamplingParams(max_tokens=MAX_TOKENS, greedy=True,
                                    stop_token_ids=(END_ID,)))
    return out


def _run_engine(engine_dir, batch: list[DecodeRequest], *, chunked: bool = False) -> list[dict]:
    """One ModelRunnerCpp generate call for the batch: per request its greedy tokens, its
    context logits (the engines gather them) and its generation logits (fp32 CPU). `chunked`:
    the executor's chunked context, as the repository's enable_chunked_context sets it
    (tensorrt_llm/runtime/model_runner_cpp.py from_dir, enable_chunked_context)."""
    from tensorrt_llm.layers import MropeParams
    from tensorrt_llm.runtime import ModelRunnerCpp

    import qvl_trt.llm.network  # noqa: F401  (registers the architecture EngineConfig reads)

    runner = ModelRunnerCpp.from_dir(str(engine_dir), rank=0, gather_generation_logits=True,
                                     kv_cache_free_gpu_memory_fraction=0.3,
                                     enable_chunked_context=chunked)
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
            results.append({
                "tokens": tokens.tolist(),
                "context_logits": out["context_logits"][b, : len(ids), :vocab].float().cpu(),
                "generation_logits": out["generation_logits"][b, 0, : len(tokens), :vocab]
                .float().cpu(),
            })
        return results
    finally:
        runner.session.shutdown()


def _in_dtype(request: DecodeRequest, dtype: str) -> DecodeRequest:
    """The request with its prompt table rounded to `dtype` (the runtime takes the table in
    the engine dtype), kept float32 so the reference sees the very same values."""
    table = torch.from_numpy(np.asarray(request.prompt_table, np.float32))
    return replace(request, prompt_table=table.to(getattr(torch, dtype)).float().numpy())


def _run_reference(decoder: ReferenceDecoder, batch: list[DecodeRequest]) -> list[dict]:
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


def _assert_matches(got: dict, want: dict, tolerance: float, name: str) -> None:
    """Engine run `got` against reference run `want`, as the module docstring says."""
    assert torch.isfinite(got["context_logits"]).all(), name
    assert _max_diff(got["context_logits"], want["context_logits"]) <= tolerance, name
    tokens, expected = _strip_end(got["tokens"]), _strip_end(want["tokens"])
    split = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
                 None if len(tokens) == len(expected) else min(len(tokens), len(expected)))
    # The logits of step s follow from tokens < s: comparable up to the first difference.
    steps = min(len(got["generation_logits"]), len(want["generation_logits"]),
                MAX_TOKENS if split is None else split + 1)
    assert _max_diff(got["generation_logits"][:steps],
                     want["generation_logits"][:steps]) <= tolerance, name
    if split is not None:
        chosen = tokens[split] if split < len(tokens) else END_ID
        logits = want["generation_logits"][split]
        gap = float(logits.max() - logits[chosen])
        assert gap <= 2 * tolerance, (
            f"{name}: the engine chose token {chosen} at step {split}, {gap:.3f} below the "
            "reference's best logit: not a near-tie")


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_engine_folder(built, profile, tiny_ckpt, dtype):
    _, engine_dir = built[dtype]
    config = json.loads((engine_dir / "config.json").read_text())
    build, pretrained = config["build_config"], config["pretrained_config"]
    k = open_checkpoint(tiny_ckpt).vision.deepstack_count
    assert build["use_mrope"] is True
    assert build["max_prompt_embedding_table_size"] == prompt_table_rows(profile.limits, k)
    plugins = build["plugin_config"]
    assert plugins["gemm_plugin"] == plugins["gpt_attention_plugin"] == dtype
    assert plugins["context_fmha"] is True and plugins["paged_kv_cache"] is True
    assert pretrained["architecture"] == "Qwen3VLForCausalLM"
    assert pretrained["dtype"] == dtype
    assert pretrained["max_position_embeddings"] == profile.limits.max_seq_len
    assert pretrained["num_deepstack_layers"] == k
    assert (engine_dir / "rank0.engine").stat().st_size > 0
    assert (engine_dir.parent / "reproduce.sh").is_file()


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("name", ["text", "one_image", "two_images"])
def test_single_request_matches_the_reference(built, references, requests, dtype, name):
    request = _in_dtype(requests[name], dtype)
    engine = _run_engine(built[dtype][1], [request])[0]
    reference = _run_reference(references[dtype], [request])[0]
    _assert_matches(engine, reference, TOLERANCE[dtype], name)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_batch_of_four_mixed_requests_matches_the_reference(built, references, requests,
                                                            dtype):
    batch = [_in_dtype(requests[name], dtype) for name in CASES]
    engine = _run_engine(built[dtype][1], batch)
    reference = _run_reference(references[dtype], batch)
    for name, got, want in zip(CASES, engine, reference, strict=True):
        _assert_matches(got, want, TOLERANCE[dtype], name)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_stale_nan_in_a_text_requests_table_changes_nothing(built, requests, tiny_ckpt,
                                                            dtype):
    """The runtime's prompt-table buffer is never zeroed, so the row a text token reads may
    hold NaN: it must be selected away, not multiplied by 0. A NaN-filled table on the text
    request, batched with an image request, gives the logits of a zero table."""
    engine_dir = built[dtype][1]
    image = _in_dtype(requests["one_image"], dtype)
    rows = image.prompt_table.shape[0]  # _run_engine pads every table to the widest
    hidden = open_checkpoint(tiny_ckpt).text.hidden_size

    def with_table(fill: float) -> list[DecodeRequest]:
        text = replace(requests["text"], prompt_table=np.full((rows, hidden), fill, np.float32))
        return [image, text]

    clean, poisoned = _run_engine(engine_dir, with_table(0.0)), _run_engine(engine_dir,
                                                                             with_table(np.nan))
    for want, got in zip(clean, poisoned, strict=True):
        assert torch.isfinite(got["context_logits"]).all()
        assert torch.isfinite(got["generation_logits"]).all()
        assert got["tokens"] == want["tokens"]
        assert torch.equal(got["context_logits"], want["context_logits"])
        assert torch.equal(got["generation_logits"], want["generation_logits"])


def test_request_with_the_most_rows_a_slot_holds_is_accepted(built, requests, profile,
                                                             tiny_ckpt):
    """Each request may send max_prompt_embedding_table_size / max_batch_size rows (the
    runtime rejects more); with the table sized by prompt_table_rows that many are accepted
    and, unreferenced by a text prompt, change nothing."""
    engine_dir = built["float16"][1]
    k = open_checkpoint(tiny_ckpt).vision.deepstack_count
    per_request = prompt_table_rows(profile.limits, k) // profile.limits.max_batch_size
    hidden = open_checkpoint(tiny_ckpt).text.hidden_size
    rng = np.random.default_rng(1)
    full = replace(requests["text"],
                   prompt_table=rng.normal(0, 1, (per_request, hidden)).astype(np.float32))
    small = replace(requests["text"], prompt_table=np.zeros((1 + k, hidden), np.float32))
    got, want = _run_engine(engine_dir, [full])[0], _run_engine(engine_dir, [small])[0]
    assert got["tokens"] == want["tokens"]
    assert torch.equal(got["context_logits"], want["context_logits"])


def test_a_long_context_engine_prefills_a_prompt_above_max_num_tokens_in_chunks(
        tiny_ckpt, profile, tmp_path_factory):
    """The long workload's engine (262144 positions, the MRoPE table sized to them, paged
    context FMHA) takes a prompt of several max_num_tokens chunks with chunked context, an
    image across a chunk boundary, and matches the fp32 reference decoder's one-pass
    prefill."""
    ckpt = open_checkpoint(tiny_ckpt)
    plan = make_plan(ckpt, profile, workload=Workload.LONG)
    assert plan.fits and plan.limits.max_seq_len == 262144, plan.problems
    long = replace(profile, limits=plan.limits)
    chunk = long.limits.max_num_tokens
    converted, engine_dir = _convert_and_build(tiny_ckpt, long,
                                               tmp_path_factory.mktemp("long"), "long")
    config = json.loads((engine_dir / "config.json").read_text())
    assert config["build_config"]["max_seq_len"] == 262144
    assert config["build_config"]["plugin_config"]["use_paged_context_fmha"] is True
    assert config["pretrained_config"]["max_position_embeddings"] == 262144
    pre = RequestPreprocessor.from_checkpoint(tiny_ckpt, RequestLimits.from_profile(long))
    rng = np.random.default_rng(2)
    # Text before the image puts its tokens across the first chunk boundary; the rest makes
    # the prompt more than two chunks.
    before, after = "sea " * (chunk - 13), "wave " * (chunk + 100)
    image = Image.fromarray(rng.integers(0, 256, (128, 128, 3), dtype=np.uint8))
    prepared = pre.prepare(messages=[{"role": "user", "content": [
        {"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]}],
        images=[image])
    ids = prepared.engine_input_ids
    visual = [i for i, t in enumerate(ids) if t >= ckpt.text.vocab_size]
    assert len(ids) > 2 * chunk and visual[0] < chunk <= visual[-1]
    hidden, per_token = ckpt.text.hidden_size, 1 + ckpt.vision.deepstack_count
    scale = float(ckpt.load("model.language_model.embed_tokens.weight").float().std())
    main, *deepstack = (rng.normal(0, scale, (len(visual), hidden)).astype(np.float32)
                        for _ in range(per_token))
    request = _in_dtype(DecodeRequest(
        input_ids=tuple(int(t) for t in ids),
        mrope_rotary_cos_sin=prepared.mrope_rotary_cos_sin,
        mrope_position_delta=prepared.mrope_position_delta,
        prompt_table=assemble_prompt_table(main, deepstack),
        sampling=SamplingParams(max_tokens=MAX_TOKENS, greedy=True, stop_token_ids=(END_ID,))),
        "float16")
    engine = _run_engine(engine_dir, [request], chunked=True)[0]
    reference = ReferenceDecoder.load(converted, device="cuda", dtype="float32")
    _assert_matches(engine, _run_reference(reference, [request])[0], TOLERANCE["float16"],
                    "long prompt")


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


# ---- weight-only INT8 / INT4 -----------------------------------------------------------------

# Max |logit difference| of a weight-only float16 engine from the float32 reference decoder on
# the same weight-only checkpoint: the reference dequantizes as the GEMM does (q x scale in
# float16), so only the float16 arithmetic of the engine differs, as for the plain float16
# engine; the plugin's small-batch GEMV kernels round partial sums in float16 as well, hence
# twice that engine's tolerance. A wrong GEMM layout or scale layout moves the logits by far
# more (tests/test_llm_weight_only.py: scales off by one channel ~0.35 on these models).
WEIGHT_ONLY_TOLERANCE = {"int8": 2e-2, "int4": 2e-2}


@pytest.fixture(scope="module")
def built_weight_only(tiny_ckpt, profile, tmp_path_factory):
    """weights -> (converted weight-only float16 checkpoint, engine folder)."""
    root = tmp_path_factory.mktemp("weight-only-engines")
    return {weights: _convert_and_build(tiny_ckpt, profile, root, weights, weights=weights)
            for weights in WEIGHT_ONLY_TOLERANCE}


@pytest.mark.parametrize("weights", list(WEIGHT_ONLY_TOLERANCE))
def test_weight_only_engine_folder(built_weight_only, weights):
    config = json.loads((built_weight_only[weights][1] / "config.json").read_text())
    assert config["pretrained_config"]["quantization"]["quant_algo"] == {
        "int8": "W8A16", "int4": "W4A16"}[weights]
    plugins = config["build_config"]["plugin_config"]
    assert plugins["weight_only_quant_matmul_plugin"] == "float16"


@pytest.mark.parametrize("weights", list(WEIGHT_ONLY_TOLERANCE))
def test_weight_only_engine_matches_its_reference(built_weight_only, requests, weights):
    ckpt, engine_dir = built_weight_only[weights]
    reference = ReferenceDecoder.load(ckpt, device="cuda", dtype="float32")
    batch = [_in_dtype(requests[name], "float16") for name in CASES]
    for name, got, want in zip(CASES, _run_engine(engine_dir, batch),
                               _run_reference(reference, batch), strict=True):
        _assert_matches(got, want, WEIGHT_ONLY_TOLERANCE[weights], f"{weights} {name}")


@pytest.mark.parametrize("weights", list(WEIGHT_ONLY_TOLERANCE))
@pytest.mark.parametrize("out_features, in_features", [(256, 64), (6144, 2048)])
def test_quantize_is_the_loaders_op(weights, out_features, in_features):
    """The reference decoder's `quantize` against the C++ op TensorRT-LLM's loader quantizes
    the checkpoint with at engine build (tensorrt_llm/models/convert_utils.py
    weight_only_quantize: the [in, out] weight through
    torch.ops.trtllm.symmetric_quantize_last_axis_of_batched_matrix), on this GPU: the op's
    scales are ours to the bit, and its integers, laid out for this GPU's mixed GEMM, are
    torch.ops.trtllm.preprocess_weights_for_mixed_gemm of ours (the layout step the op runs
    after quantizing: cutlass_preprocessors.cpp symmetric_quantize). The weight has a zero
    channel, exact halves and a channel whose max is negative."""
    import tensorrt_llm  # noqa: F401  (loads the torch.ops.trtllm operators)

    mode = WeightOnly(weights)
    kind = torch.int8 if mode is WeightOnly.INT8 else torch.quint4x2
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).half()
    weight[0] = 0
    weight[1, :6] = torch.tensor([1.0, 2.5 / 128, -2.5 / 128, 0.5 / 128, 2.5 / 8, -0.5 / 8])
    weight[1, 6:] = 0
    weight[2, 0] = -1.0
    ints, scales = quantize(weight, mode, Dtype.FLOAT16)
    laid_out, op_scales = torch.ops.trtllm.symmetric_quantize_last_axis_of_batched_matrix(
        weight.t().contiguous(), kind)
    assert torch.equal(op_scales.view(torch.int16), scales.view(torch.int16))
    assert torch.equal(
        torch.ops.trtllm.preprocess_weights_for_mixed_gemm(ints, kind, torch.float16), laid_out)
