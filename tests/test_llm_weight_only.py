"""Weight-only INT8/INT4: the quantizer against an independent numpy implementation of
TensorRT-LLM's scheme on real layer shapes, the checkpoint TensorRT-LLM's loader quantizes
(the linears in the model dtype, config.json's quant_algo) and the refusal of the earlier
pre-quantized layout, and the reference decoder on weight-only checkpoints against the fp16
one (stated tolerances; a broken scale fails them). The quantizer against the loader's own op
is tests/test_llm_engine_trtllm.py (TensorRT-LLM and a GPU).

The scheme, as cpp/tensorrt_llm/kernels/cutlass_kernels/cutlass_preprocessors.cpp
`symmetric_quantize` states it for the [in, out] (transposed) weight: per column, scale =
float32 max |w| x 1/2^(bits-1); q = C round(w / scale) (halves away from zero), clipped to
the signed range, 0 where the scale is 0; scales stored in the weight's dtype; INT4 packed
two per byte along the column axis, even column in the low nibble (two's complement).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qvl_trt.checkpoint import open_checkpoint
from qvl_trt.dtypes import Dtype, WeightOnly
from qvl_trt.errors import CheckpointError
from qvl_trt.llm.agreement import compare_decoders
from qvl_trt.llm.convert import convert_checkpoint
from qvl_trt.llm.reference import ReferenceDecoder
from qvl_trt.llm.sampling import DecodeRequest, SamplingParams
from qvl_trt.llm.weight_only import dequantize, is_quantized, quantize
from qvl_trt.mm.rope import MropeTable

MODES = (WeightOnly.INT8, WeightOnly.INT4)


def numpy_quantize(weight: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The scheme written from the upstream source, independently of qvl_trt: the [out, in]
    fp16 weight -> (packed int8 [in, out * bits / 8], fp16 scales [out])."""
    v = weight.T.astype(np.float32)  # [in, out]: the op quantizes the last axis
    col = np.abs(v).max(axis=0) * np.float32(1.0 / (1 << (bits - 1)))
    scaled = np.zeros_like(v)
    np.divide(v, col, out=scaled, where=col != 0)  # float32 division, as the C++ code does
    wide = scaled.astype(np.float64)  # |x| + 0.5 is exact in float64 for these magnitudes
    rounded = np.copysign(np.floor(np.abs(wide) + 0.5), wide)
    q = np.clip(rounded, -(1 << (bits - 1)), (1 << (bits - 1)) - 1).astype(np.int8)
    if bits == 4:
        nibbles = q.view(np.uint8) & 0x0F
        q = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return q, col.astype(np.float16)


@functools.lru_cache(maxsize=1)  # the two modes of a shape run one after the other
def _weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random fp16 weight with the cases that tell implementations apart: a zero row, exact
    halves (ties), the channel max on the negative side and on the positive side."""
    generator = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=generator) * 0.02).half().numpy()
    w[0] = 0
    # Row 1: max 1.0, so the INT8 scale is 1/128 and INT4's 1/8: +-2.5 and +-0.5 steps.
    w[1, :6] = [1.0, 2.5 / 128, -2.5 / 128, 0.5 / 128, 2.5 / 8, -0.5 / 8]
    w[1, 6:] = 0
    w[2, 0] = -1.0  # a channel whose max is negative: it reaches -128 / -8
    return torch.from_numpy(w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("out_features, in_features", [
    (6144, 2048),  # 2B: mlp.fc / mlp.gate
    (6144, 4096),  # 8B: attention.qkv (32 + 2 x 8 heads of 128)
])
def test_quantizer_matches_an_independent_numpy_implementation(out_features, in_features,
                                                               mode):
    weight = _weight(out_features, in_features, seed=out_features + in_features)
    ints, scales = quantize(weight, mode, Dtype.FLOAT16)
    expected_ints, expected_scales = numpy_quantize(weight.numpy(), mode.bits)
    assert ints.dtype == torch.int8 and scales.dtype == torch.float16
    assert tuple(ints.shape) == (in_features, out_features * mode.bits // 8)
    assert tuple(scales.shape) == (out_features,)
    assert np.array_equal(ints.numpy(), expected_ints)
    assert np.array_equal(scales.numpy().view(np.uint16), expected_scales.view(np.uint16))


def test_ties_round_away_from_zero_and_the_range_is_asymmetric():
    """The crafted row pins what the comparison above would miss if both sides shared a
    mistake: halves go away from zero (torch.round and np.round go to even), the positive
    max clips to 127 / 7 and the negative one reaches -128 / -8."""
    weight = _weight(64, 64, seed=1)
    int8, scale8 = quantize(weight, WeightOnly.INT8, Dtype.FLOAT16)
    assert float(scale8[1]) == 1 / 128
    assert int8[:6, 1].tolist() == [127, 3, -3, 1, 40, -8]
    assert int8[0, 2] == -128 and int8[:, 0].eq(0).all() and scale8[0] == 0
    int4, scale4 = quantize(weight, WeightOnly.INT4, Dtype.FLOAT16)
    assert float(scale4[1]) == 1 / 8
    # Column 1 is the high nibble of byte 0 of each row.
    high = torch.bitwise_right_shift(int4[:6, 0], 4).tolist()
    assert high == [7, 0, 0, 0, 3, -1]  # 0.5/128 * 8 = 1/32 -> 0; 2.5 -> 3; -0.5 -> -1
    low = torch.bitwise_right_shift(int4[:, 1] << 4, 4)
    assert low[0] == -8  # column 2: the negative max


def test_rounding_is_exact_one_float32_step_either_side_of_every_half():
    """A float32 weight whose channel max is 1.0 has the INT8 scale 1/128, so w / scale is
    exactly 128 w: these rows put every k + 0.5 and its float32 neighbours (and the same
    below zero) into the rounding, where a float32 x + 0.5 goes wrong (0.49999997 + 0.5
    rounds to 1.0) and round-to-even differs."""
    halves = np.arange(128, dtype=np.float32) + np.float32(0.5)
    near = np.concatenate([np.nextafter(halves, np.float32(0)), halves,
                           np.nextafter(halves, np.float32(200))])
    values = np.concatenate([near, -near]) / np.float32(128)
    rows = np.zeros((2, values.size + 1), dtype=np.float32)
    rows[:, 0] = 1.0
    rows[0, 1:] = values
    rows[1, 1:] = values[::-1]
    ints, scales = quantize(torch.from_numpy(rows), WeightOnly.INT8, Dtype.FLOAT16)
    expected_ints, expected_scales = numpy_quantize(rows, 8)
    assert float(scales[0]) == 1 / 128 and np.array_equal(scales.numpy(), expected_scales)
    assert np.array_equal(ints.numpy(), expected_ints)
    assert ints[1, 0] == 0 and ints[129, 0] == 1 and ints[257, 0] == 1  # 0.5 -/+ one step


@pytest.mark.parametrize("mode", MODES)
def test_dequantize_is_q_times_scale_in_the_model_dtype(mode):
    weight = _weight(128, 64, seed=2)
    ints, scales = quantize(weight, mode, Dtype.FLOAT16)
    back = dequantize(ints, scales, mode, Dtype.FLOAT16)
    q, _ = numpy_quantize(weight.numpy(), 8) if mode is WeightOnly.INT8 else (None, None)
    assert back.dtype == torch.float16 and back.shape == weight.shape
    # Off by at most one step (the positive max clips to 127 or 7 steps) plus fp16's rounding
    # of q x scale (half an ulp of |w| <= 128 steps: 1/16 of a step).
    step = scales.float()[:, None]
    assert ((back.float() - weight.float()).abs() <= step * (1 + 1 / 16)).all()
    if q is not None:
        expected = (torch.from_numpy(q.T.astype(np.float16)) * scales[:, None]).float()
        assert torch.equal(back.float(), expected)


# ---- the reference decoder on weight-only checkpoints ------------------------------------

MAX_POSITIONS = 256
# max |logit difference| against the fp16 checkpoint over the steps both took from the same
# inputs (the tiny model's logits have a standard deviation of ~0.16, max ~1); measured 0.011
# for INT8 and 0.24 for INT4.
TOLERANCE = {WeightOnly.INT8: 0.02, WeightOnly.INT4: 0.3}


@pytest.fixture(scope="module")
def checkpoints(tiny_ckpt: Path, tmp_path_factory) -> dict[WeightOnly, Path]:
    root = tmp_path_factory.mktemp("weight-only")
    return {w: convert_checkpoint(tiny_ckpt, root / w.value, max_seq_len=MAX_POSITIONS,
                                  dtype="float16", weights=w).out for w in WeightOnly}


@pytest.fixture(scope="module")
def baseline(checkpoints) -> ReferenceDecoder:
    return ReferenceDecoder.load(checkpoints[WeightOnly.NONE], dtype="float32")


@pytest.fixture(scope="module")
def requests(tiny_ckpt: Path) -> list[tuple[str, DecodeRequest]]:
    """Two text prompts of random ids, greedy, 6 tokens each."""
    table = MropeTable.of(open_checkpoint(tiny_ckpt).text, MAX_POSITIONS)
    rng = np.random.default_rng(0)
    out = []
    for n in (20, 30):
        positions = np.broadcast_to(np.arange(n), (3, n))
        out.append((f"{n} tokens", DecodeRequest(
            rng.integers(0, 1000, n), table(positions), 0,
            sampling=SamplingParams(max_tokens=6, greedy=True))))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_weight_only_logits_follow_fp16(checkpoints, baseline, requests, mode):
    candidate = ReferenceDecoder.load(checkpoints[mode], dtype="float32")
    agreement = compare_decoders(baseline, candidate, requests)
    print(f"{mode}: {agreement.summary()}")
    assert 0 < agreement.max_logit_diff <= TOLERANCE[mode], agreement.summary()
    if mode is WeightOnly.INT8:
        assert agreement.token_agreement == 1.0, agreement.summary()


def _broken(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "rank0.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "rank0.safetensors"), {"format": "pt"})
    return dst


def test_a_broken_scale_fails_the_tolerance(checkpoints, baseline, requests, monkeypatch):
    """Scales off by one output channel (a layout slip) leave the logits ~0.35 away."""
    import qvl_trt.llm.reference as reference

    monkeypatch.setattr(reference, "dequantize", lambda ints, scales, mode, dtype: dequantize(
        ints, scales.roll(1, 0), mode, dtype))
    candidate = ReferenceDecoder.load(checkpoints[WeightOnly.INT8], dtype="float32")
    agreement = compare_decoders(baseline, candidate, requests)
    assert agreement.max_logit_diff > TOLERANCE[WeightOnly.INT8], agreement.summary()


def test_tensor_parallel_pieces_are_quantized_on_their_own(tiny_ckpt, tmp_path):
    """TP 2 (a model whose features are multiples of 128): each rank's piece has its own
    scales, and the merged dequantized weights equal the TP 1 ones where the split keeps
    whole output channels."""
    from qvl_trt.testing.tiny_checkpoint import TinyDims, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "hf", dims=TinyDims(
        text_hidden=128, head_dim=64, text_intermediate=256, text_layers=2))
    one = convert_checkpoint(ckpt, tmp_path / "tp1", max_seq_len=64, weights="int8").out
    two = convert_checkpoint(ckpt, tmp_path / "tp2", max_seq_len=64, weights="int8",
                             tp_size=2).out
    rank0 = load_file(str(two / "rank0.safetensors"))
    proj = rank0["transformer.layers.0.mlp.proj.weight"]
    assert proj.dtype == torch.float16 and proj.shape == (128, 128)  # [out, in / 2]
    a = ReferenceDecoder.load(one).layers[0]
    b = ReferenceDecoder.load(two).layers[0]
    assert torch.equal(a.fc, b.fc) and torch.equal(a.qkv, b.qkv)
    assert not torch.equal(a.proj, b.proj)  # row-parallel: per-rank maxima
    assert (a.proj - b.proj).abs().max() <= 2 * a.proj.abs().max() / 128


def _earlier_layout(weights: dict, mode: WeightOnly) -> None:
    """What `convert --weights` wrote before TensorRT-LLM's loader quantized: qvl_trt's own
    row-major integers and a per_channel_scale beside each linear."""
    for name in [n for n in weights if is_quantized(n)]:
        weights[name], weights[name.removesuffix("weight") + "per_channel_scale"] = quantize(
            weights[name], mode, Dtype.FLOAT16)


def test_the_earlier_pre_quantized_layout_is_refused(checkpoints, tmp_path):
    """TensorRT-LLM's loader takes int8 linears as laid out for its GEMM already
    (weight_only_quantize_dict skips them): the reference decoder and the engine build's rank
    child (before it imports TensorRT-LLM) refuse such a checkpoint, naming the fix."""
    from qvl_trt.errors import BuildError
    from qvl_trt.llm.engine import build_engines, engine_build_config
    from qvl_trt.profiles import load_profile

    old = _broken(checkpoints[WeightOnly.INT4], tmp_path / "old",
                  lambda weights: _earlier_layout(weights, WeightOnly.INT4))
    # The first integer linear or scale in the file's order.
    reason = (r"rank0\.safetensors holds transformer\.layers\.\d+\.\S+ \((I8|F16)\): the "
              r"pre-quantized layout of earlier qvl-trt versions, which "
              r"TensorRT-LLM would take as already laid out for its GEMM; convert the HF "
              r"checkpoint again \(qvl-trt convert, or qvl-trt build --resume, which converts "
              r"it again\)")
    with pytest.raises(CheckpointError, match=reason + "$"):
        ReferenceDecoder.load(old)
    settings = engine_build_config(load_profile("4090d"), deepstack_layers=3, weights="int4")
    with pytest.raises(BuildError, match=reason):
        build_engines(old, tmp_path / "llm", {**settings, "max_seq_len": MAX_POSITIONS})


def test_a_tensor_in_another_dtype_is_refused(checkpoints, tmp_path):
    name = "transformer.layers.0.mlp.gate.weight"

    def widen(weights):
        weights[name] = weights[name].float()

    with pytest.raises(CheckpointError, match=f"holds {name} in F32, not the config's "
                       "float16; convert again"):
        ReferenceDecoder.load(_broken(checkpoints[WeightOnly.INT8], tmp_path / "f32", widen))


def test_a_quant_algo_other_than_w8a16_or_w4a16_is_refused(checkpoints, tmp_path):
    bad = Path(shutil.copytree(checkpoints[WeightOnly.INT8], tmp_path / "relabelled"))
    config = bad / "config.json"
    config.write_text(config.read_text().replace('"W8A16"', '"W4A16_AWQ"'))
    with pytest.raises(CheckpointError, match="sets quantization .*W4A16_AWQ.*; qvl-trt writes "
                       "quant_algo W8A16 or W4A16 or none"):
        ReferenceDecoder.load(bad)


# tensorrt_llm/models/convert_utils.py weight_only_quantize_dict's rule: a weight is quantized
# at engine build when its name contains one of these and it is not int8 already.
LOADER_QUANTIZES = ("qkv.weight", "dense.weight", "fc.weight", "proj.weight", "gate.weight")


def test_convert_writes_what_the_loader_quantizes(checkpoints):
    """A weight-only checkpoint is the fp16 one, byte for byte, with config.json's quant_algo
    set: the names TensorRT-LLM's loader quantizes are the linears the reference decoder
    quantizes, all in the model dtype, and no scales."""
    import json

    plain = (checkpoints[WeightOnly.NONE] / "rank0.safetensors").read_bytes()
    for mode in MODES:
        path = checkpoints[mode]
        config = json.loads((path / "config.json").read_text())
        assert config["quantization"] == {"quant_algo": mode.quant_algo,
                                          "kv_cache_quant_algo": None}
        assert (path / "rank0.safetensors").read_bytes() == plain
    tensors = load_file(str(checkpoints[WeightOnly.INT8] / "rank0.safetensors"))
    loader = {n for n in tensors if any(p in n for p in LOADER_QUANTIZES)}
    assert loader == {n for n in tensors if is_quantized(n)} and len(loader) == 5 * 4
    assert {t.dtype for t in tensors.values()} == {torch.float16}
    # The engine's bytes of each linear, as the planner counts them (WeightOnly.linear_bytes).
    for mode in MODES:
        for name in loader:
            out_features, in_features = tensors[name].shape
            ints, scales = quantize(tensors[name], mode, Dtype.FLOAT16)
            assert ints.nbytes + scales.nbytes == mode.linear_bytes(in_features, out_features,
                                                                    Dtype.FLOAT16)


def test_feature_sizes_that_tensorrt_llm_would_pad_are_refused(tiny_ckpt, tmp_path):
    from qvl_trt.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--weights int8 needs the model's hidden size \(64\) "
                       r"to be a multiple of 128 \(64 x TP size 2\); use a smaller --tp-size "
                       "or --weights none"):
        convert_checkpoint(tiny_ckpt, tmp_path / "out", max_seq_len=64, weights="int8",
                           tp_size=2)
    with pytest.raises(ConfigError, match="weights 'int2' is not one of none, int8, int4"):
        convert_checkpoint(tiny_ckpt, tmp_path / "out", max_seq_len=64, weights="int2")
    assert not (tmp_path / "out").exists()


def test_agreement_command_reports_int8_against_fp16(tiny_ckpt, checkpoints, tmp_path):
    """`qvl-trt agreement`: the cases through the served preprocessing, both checkpoints
    greedy."""
    import json

    from typer.testing import CliRunner

    from qvl_trt.cli import app

    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps([{"name": "text", "prompt": "Say something.",
                                  "max_tokens": 3}]))
    done = CliRunner().invoke(app, [
        "agreement", "--cases", str(cases), "--model", str(tiny_ckpt), "--json",
        "--baseline", str(checkpoints[WeightOnly.NONE]),
        "--candidate", str(checkpoints[WeightOnly.INT8])])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert [c["name"] for c in report["cases"]] == ["text"]
    assert report["token_agreement"] == 1.0
    assert 0 < report["max_logit_diff"] <= TOLERANCE[WeightOnly.INT8]
    assert len(report["cases"][0]["baseline"]) == 3


def test_agreement_lines():
    from qvl_trt.cli.console import agreement_lines
    from qvl_trt.llm.agreement import Agreement, CaseAgreement

    result = Agreement((CaseAgreement("a", (1, 2, 3), (1, 2, 3), None, 0.01),
                        CaseAgreement("b", (1, 2, 3, 4), (1, 5, 3, 4), 1, 0.25)))
    assert result.token_agreement == 4 / 7 and result.max_logit_diff == 0.25
    assert agreement_lines(result) == [
        "a: 3 tokens, identical, max logit difference 0.01",
        "b: 4 tokens, first divergence at token 1, max logit difference 0.25",
        "1 of 2 cases identical, greedy-token agreement 57.1%, max logit difference 0.25"]
