"""Model configs as protobufs and the python models' typed parameters (qvl_trt/triton/model_configs.py, contract.py)."""

from __future__ import annotations

import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.mm.rope import MropeTable
from qvl_trt.triton import contract as c

MROPE = MropeTable(head_dim=128, rope_theta=5e6, mrope_section=(24, 20, 20),
                   mrope_interleaved=True, max_positions=1024)


def test_config_protobufs_parse_back_with_bool_parameters_and_scalar_reshapes() -> None:
    from qvl_trt.triton.model_configs import Flavor, StepSettings, step_configs
    from qvl_trt.triton.pbconfig import parameters, parse_config, to_text

    settings = StepSettings(c.ModelNames.for_build("b4"), Flavor.TRT, max_batch_size=4,
                            hidden_size=64, patch_dim=1536, table_dtype="FP16",
                            mrope=MROPE, engine_dir="/models/b4_tensorrt_llm/1/engine")
    configs = step_configs(settings)
    assert set(configs) == set(c.ModelNames.for_build("b4").all()) == {
        "b4", "b4_preprocessing", "b4_vision_encoder", "b4_tensorrt_llm", "b4_postprocessing",
        "b4_tensorrt_llm_bls"}
    for name, config in configs.items():
        text = to_text(config)
        assert "${" not in text
        back = parse_config(text, name)
        assert back == config and back.max_batch_size == 4
    llm = configs["b4_tensorrt_llm"]
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["enable_kv_cache_reuse"] == "true" and params["max_beam_width"] == "1"
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert llm.model_transaction_policy.decoupled
    lengths = next(i for i in llm.input if i.name == c.INPUT_LENGTHS)
    assert lengths.HasField("reshape") and list(lengths.reshape.shape) == []
    table = next(i for i in llm.input if i.name == c.PROMPT_EMBEDDING_TABLE)
    assert list(table.dims) == [-1, 64]
    post = configs["b4_postprocessing"]
    assert post.parameters["tensorrt_llm_model"].string_value == "b4_tensorrt_llm"
    # The MRoPE table it builds, read back as the model and `qvl-trt verify` read it.
    assert c.PostprocessingParameters.from_parameters(parameters(post)).mrope_table() == MROPE
    steps = [s.model_name for s in configs["b4"].ensemble_scheduling.step]
    assert steps == ["b4_preprocessing", "b4_vision_encoder", "b4_postprocessing"]
    bls = configs["b4_tensorrt_llm_bls"]
    assert bls.model_transaction_policy.decoupled
    assert {k: v.string_value for k, v in bls.parameters.items()} == {
        "preprocessing_model": "b4_preprocessing", "vision_encoder_model": "b4_vision_encoder",
        "tensorrt_llm_model": "b4_tensorrt_llm", "batch_slots": "4", "max_queue": "0",
        "max_queue_wait_s": "0.0", "max_seq_len": "1024",
        "head_dim": "128", "rope_theta": "5000000.0", "mrope_section": "24,20,20",
        "mrope_interleaved": "true"}
    bls_params = c.TensorrtLlmBlsParameters.from_parameters(parameters(bls))
    assert bls_params.workers == 4 + 0 + 1 and bls_params.mrope_table() == MROPE
    assert [i.name for i in bls.input] == [s.name for s in c.ENSEMBLE_INPUTS]
    assert [o.name for o in bls.output] == [s.name for s in c.ENSEMBLE_OUTPUTS]


def test_python_model_parameters_round_trip_and_name_a_bad_key() -> None:
    from dataclasses import asdict

    from qvl_trt.mm.request import RequestBounds, RequestLimits
    from qvl_trt.mm.video import VideoLimits
    from qvl_trt.triton.pbconfig import new_config, parameters, set_parameters

    written = c.PreprocessingParameters(
        max_images=2, max_input_len=512, max_seq_len=640, min_pixels=4096, max_pixels=65536,
        max_visual_tokens=128, default_max_tokens=64, image_url_allow_list="a.com,b.org",
        **asdict(RequestBounds(max_stop_words=3)), **asdict(VideoLimits(max_video_frames=9)))
    config = new_config("pre", backend="python", max_batch_size=1)
    set_parameters(config, written.to_parameters())
    params = parameters(config)
    assert params["max_seq_len"] == "640"  # one name from the writer to the reader
    assert c.PreprocessingParameters.from_parameters(params) == written
    # Every bound reaches the model: the parameters carry RequestBounds field for field.
    assert RequestLimits.from_fields(written).bounds == RequestBounds(max_stop_words=3)
    assert RequestLimits.from_fields(written).video == VideoLimits(max_video_frames=9)
    assert RequestLimits.from_fields(written) == RequestLimits(
        max_images=2, max_input_len=512, max_seq_len=640, min_pixels=4096, max_pixels=65536,
        max_visual_tokens=128, bounds=RequestBounds(max_stop_words=3),
        video=VideoLimits(max_video_frames=9))
    vision = c.VisionEncoderParameters(c.Flavor.REFERENCE, "auto", "float32", 2**20)
    assert vision.to_parameters()["flavor"] == "reference"
    assert c.VisionEncoderParameters.from_parameters(
        {k: str(v) for k, v in vision.to_parameters().items()}) == vision
    with pytest.raises(ConfigError, match=r"pre: missing key 'max_visual_tokens'"):
        c.PreprocessingParameters.from_parameters(
            {k: v for k, v in params.items() if k != "max_visual_tokens"}, "pre")
    with pytest.raises(ConfigError, match=r"post\.max_queue: expected an integer, got 'many'"):
        c.PostprocessingParameters.from_parameters(
            {"tensorrt_llm_model": "tensorrt_llm", "max_queue": "many"}, "post")
    with pytest.raises(ConfigError, match=r"unknown key 'max_positions'"):
        c.PreprocessingParameters.from_parameters({**params, "max_positions": "640"})
    with pytest.raises(ConfigError, match=r"'gpu' is not one of 'trt', 'reference'"):
        c.VisionEncoderParameters.from_parameters(
            {"flavor": "gpu", "device": "auto", "dtype": "float32", "cache_bytes": "1"})


def test_string_parameters_read_bools_as_set_parameters_writes_them() -> None:
    from dataclasses import dataclass

    from qvl_trt.triton.pbconfig import new_config, parameters, set_parameters
    from qvl_trt.typed_config import load_parameters, to_parameters

    @dataclass(frozen=True)
    class Flags:
        on: bool
        ratio: float

    config = new_config("m", backend="python", max_batch_size=1)
    set_parameters(config, to_parameters(Flags(True, 0.5)))
    assert parameters(config) == {"on": "true", "ratio": "0.5"}
    assert load_parameters(Flags, parameters(config), "m") == Flags(True, 0.5)
    with pytest.raises(ConfigError, match=r"m\.on: expected true or false, got 'yes'"):
        load_parameters(Flags, {"on": "yes", "ratio": "1"}, "m")
    with pytest.raises(ConfigError, match=r"m\.ratio: expected a number, got 'half'"):
        load_parameters(Flags, {"on": "true", "ratio": "half"}, "m")


@pytest.mark.parametrize("section", ["24,20", "24,20,x", "24,20,21"])
def test_a_bad_mrope_section_is_refused_in_one_line(section) -> None:
    params = c.PostprocessingParameters(
        tensorrt_llm_model="tensorrt_llm", batch_slots=2, max_queue=8, max_queue_wait_s=0,
        **{**c.PostprocessingParameters.mrope_fields(MROPE), "mrope_section": section})
    with pytest.raises(ConfigError, match="is not three slot counts summing to head_dim / 2 "
                                          "= 64; regenerate"):
        params.mrope_table()
