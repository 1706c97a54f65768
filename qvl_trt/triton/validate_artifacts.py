"""The files a model repository's configs point at, against the build that wrote it
(`<ensemble>/1/build.json`): the tokenizer and preprocessing files, guided decoding's tokenizer
info (against the tokenizer, the end tokens and the engine's vocabulary), the vision engine
(TensorRT edition, compute capability, pixel dtype, patches), and the LLM engine: its ranks,
limits, MRoPE support, weight-only plugin, the MRoPE table its callers build, the KV budget
and the prompt table. A reference-flavor repository's checkpoints stand in for the engines.
validate.py calls `check_artifacts` once the configs' wiring is checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..checkpoint import PIXELS_PER_PATCH, PREPROCESSING_REQUIRED_FILES
from ..dtypes import Dtype
from ..errors import ConfigError, QvlError
from ..generation_config import GenerationConfig
from ..llm.engine import FUSED_ATTENTION_DTYPES, prompt_table_element_bound
from ..llm.guided import BACKEND as GUIDED_DECODING_BACKEND
from ..llm.guided import TokenizerInfo
from ..manifest import BUILD_CONFIG_NAME, CONFIG_NAME, VISION_ENGINE_NAME
from ..mm.vision_index import PIXEL_VALUES
from ..typed_config import to_jsonable
from ..vision.spec import PIXEL_DTYPE
from . import contract as c
from .layout import (
    BUILD_INFO,
    CHECKPOINT_DIR,
    ENGINE_DIR,
    TOKENIZER_INFO_NAME,
    TOKENIZER_JSON,
    VERSION,
    VISION_WEIGHTS_NAME,
    BuildInfo,
)
from .options import Flavor
from .pbconfig import data_type_name, get_parameter, parameters
from .tensorrtllm_backend import EngineLimits, parse_bool, parse_int
from .validation_report import ValidationReport


def check_artifacts(repo: Path, ensemble: str, configs: dict[str, Any],
                    callers: dict[str, c.PostprocessingParameters],
                    report: ValidationReport) -> None:
    """Engines and weights of a repository written by `qvl-trt repo`, against build.json."""
    info_path = repo / ensemble / VERSION / BUILD_INFO
    if not info_path.is_file():
        return  # not written by qvl-trt: nothing to check the engines against
    try:
        info = BuildInfo.read(info_path)
    except ConfigError as exc:
        report.check(False, f"{ensemble}/{VERSION}/{BUILD_INFO}", str(exc))
        return
    models = to_jsonable(info.models)
    flavor = info.flavor
    for key, model in models.items():
        if key != "ensemble":
            report.check(model in configs, ensemble, f"{key} model {model} is missing")

    def present(where: str, base: Path, names: Iterable[str]) -> None:
        for n in names:
            report.check((base / n).is_file(), where, f"{(base / n).relative_to(repo)} is "
                         "missing; regenerate the repository with `qvl-trt repo`")

    pre = repo / models["preprocessing"] / VERSION / CHECKPOINT_DIR
    present(models["preprocessing"], pre, PREPROCESSING_REQUIRED_FILES)
    for key in ("postprocessing", "tensorrt_llm_bls"):
        present(models[key], repo / models[key] / VERSION, [TOKENIZER_JSON])
    vision = repo / models["vision_encoder"] / VERSION
    llm = repo / models["tensorrt_llm"] / VERSION
    if models["tensorrt_llm"] in configs:
        _check_guided_decoding(repo, models, configs[models["tensorrt_llm"]], flavor, report)
    if flavor is Flavor.REFERENCE:
        present(models["vision_encoder"], vision / CHECKPOINT_DIR,
                ["config.json", "preprocessor_config.json", VISION_WEIGHTS_NAME])
        present(models["tensorrt_llm"], llm / CHECKPOINT_DIR,
                [CONFIG_NAME] + [f"rank{r}.safetensors" for r in range(info.tp_size)])
        present(models["tensorrt_llm"], llm, [BUILD_CONFIG_NAME])
        return
    _check_vision_engine(models["vision_encoder"], vision / ENGINE_DIR, info, report)
    llm_name = models["tensorrt_llm"]
    if llm_name in configs:
        _check_llm_engine(llm_name, configs[llm_name], llm / ENGINE_DIR, info, report,
                          {n: p for n, p in callers.items() if p.tensorrt_llm_model == llm_name})


def _check_guided_decoding(repo: Path, models: dict[str, str], config: Any, flavor: Flavor,
                           report: ValidationReport) -> None:
    """tensorrt_llm's guided decoding parameters (the stock backend's, or the reference
    model's of the same names) and the tokenizer info file they name, against the tokenizer,
    the end tokens and the engine's vocabulary."""
    name = models["tensorrt_llm"]
    version = repo / name / VERSION
    params = parameters(config)
    backend = params.get("guided_decoding_backend", "")
    path = params.get("xgrammar_tokenizer_info_path", "")
    if not backend and not path:
        return  # off; a guided request is refused by the executor
    if not report.check(bool(backend) and bool(path), name,
                        f"guided decoding is off: guided_decoding_backend is {backend!r}, "
                        f"xgrammar_tokenizer_info_path {path!r}, and the backend needs both "
                        "(every guided request would fail); set both or neither"):
        return
    report.check(backend == GUIDED_DECODING_BACKEND, name,
                 f"guided_decoding_backend is {backend!r}; the backend takes only "
                 f"{GUIDED_DECODING_BACKEND}")
    if flavor is Flavor.TRT:
        # Absolute as the container sees it (the backend opens it as given); serve re-points
        # it with gpt_model_path when the repository moved.
        if not report.check(path.endswith(f"/{name}/{VERSION}/{TOKENIZER_INFO_NAME}")
                            and path.startswith("/"), name,
                            f"xgrammar_tokenizer_info_path {path!r} does not name this model's "
                            f"{name}/{VERSION}/{TOKENIZER_INFO_NAME}; regenerate with "
                            "`qvl-trt repo`"):
            return
        file = version / TOKENIZER_INFO_NAME
        engine_config = version / ENGINE_DIR / CONFIG_NAME
        vocab_source = (json.loads(engine_config.read_text()).get("pretrained_config", {})
                        if engine_config.is_file() else None)
    else:
        file = version / path
        checkpoint_config = version / CHECKPOINT_DIR / CONFIG_NAME
        vocab_source = (json.loads(checkpoint_config.read_text())
                        if checkpoint_config.is_file() else None)
    if not report.check(file.is_file(), name, f"{file.relative_to(repo)} is missing (the "
                        "backend fails to load without it); regenerate with `qvl-trt repo`"):
        return
    try:
        info = TokenizerInfo.read(file)
    except ConfigError as exc:
        report.check(False, name, str(exc))
        return
    tokenizer = repo / models["postprocessing"] / VERSION / TOKENIZER_JSON
    if tokenizer.is_file():
        vocab = TokenizerInfo.of_tokenizer(tokenizer, info.stop_token_ids).encoded_vocab
        differ = next((i for i, (a, b) in enumerate(zip(vocab, info.encoded_vocab, strict=False))
                       if a != b), min(len(vocab), len(info.encoded_vocab)))
        report.check(vocab == info.encoded_vocab, name,
                     f"{TOKENIZER_INFO_NAME} does not match the tokenizer: "
                     f"{len(info.encoded_vocab)} tokens against its {len(vocab)} (added tokens "
                     "included), first "
                     f"difference at id {differ}; regenerate with `qvl-trt repo`")
    if vocab_source is not None:
        vocab_size = vocab_source.get("vocab_size", 0)
        report.check(len(info.encoded_vocab) <= vocab_size, name,
                     f"{TOKENIZER_INFO_NAME} has {len(info.encoded_vocab)} tokens, the LLM's "
                     f"vocab_size is {vocab_size}: the mask covers the engine's vocabulary")
    end_ids = _end_ids(repo / models["preprocessing"] / VERSION / CHECKPOINT_DIR)
    if end_ids is not None:
        report.check(set(info.stop_token_ids) == set(end_ids), name,
                     f"{TOKENIZER_INFO_NAME} stop_token_ids {list(info.stop_token_ids)} are not "
                     f"the end tokens preprocessing ends answers with {list(end_ids)}: a "
                     "complete guided answer could not end; regenerate with `qvl-trt repo`")


def _end_ids(checkpoint: Path) -> tuple[int, ...] | None:
    """The end tokens preprocessing sends (the checkpoint's generation config); None where
    its files are missing (reported elsewhere)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
        generation = checkpoint / "generation_config.json"
        data = json.loads(generation.read_text()) if generation.is_file() else None
        return GenerationConfig.from_json(data, config).end_ids
    except (OSError, ValueError, QvlError):
        return None


def _check_vision_engine(name: str, folder: Path, info: BuildInfo,
                         report: ValidationReport) -> None:
    config_path = folder / CONFIG_NAME
    if not report.check((folder / VISION_ENGINE_NAME).is_file() and config_path.is_file(), name,
                        f"vision engine {folder.name}/{VISION_ENGINE_NAME} (+ {CONFIG_NAME}) "
                        "is missing; build it with `qvl-trt build --only vision` and regenerate"):
        return
    engine = json.loads(config_path.read_text())
    profile = info.profile
    report.check(engine.get("edition") == info.trt_edition.value, name,
                 f"vision engine was built with {engine.get('edition')}, the repository's "
                 f"profile {profile.name} uses {info.trt_edition.value}; rebuild it")
    cc = profile.gpu.compute_capability
    report.check(cc in engine.get("compute_capabilities", []), name,
                 f"vision engine targets compute capability "
                 f"{'/'.join(engine.get('compute_capabilities', []))}, profile {profile.name} "
                 f"is {cc}; rebuild it")
    pixels = next((t.get("dtype") for t in engine.get("inputs", [])
                   if t.get("name") == PIXEL_VALUES), None)
    report.check(pixels == PIXEL_DTYPE, name,
                 f"vision engine takes {pixels} pixel_values, this qvl-trt sends the images' "
                 f"{PIXEL_DTYPE} values; rebuild it with `qvl-trt build --only vision --force`")
    max_patches = profile.limits.vision_max_pixels // PIXELS_PER_PATCH
    report.check(engine.get("patches", {}).get("max", 0) >= max_patches, name,
                 f"vision engine takes at most {engine.get('patches', {}).get('max')} patches, "
                 f"the profile admits images of {max_patches}; rebuild it")


def _check_llm_engine(name: str, config: Any, folder: Path, info: BuildInfo,
                      report: ValidationReport,
                      callers: dict[str, c.PostprocessingParameters]) -> None:
    path = get_parameter(config, "gpt_model_path") or ""
    report.check(path.rstrip("/").endswith(f"{name}/{VERSION}/{ENGINE_DIR}"), name,
                 f"gpt_model_path {path!r} does not name this model's engine folder "
                 f"({name}/{VERSION}/{ENGINE_DIR}); regenerate with `qvl-trt repo`")
    config_path = folder / CONFIG_NAME
    if not report.check(config_path.is_file(), name,
                        f"LLM engine {name}/{VERSION}/{ENGINE_DIR}/{CONFIG_NAME} is missing; build "
                        "it with `qvl-trt build --resume BUILD` in the TensorRT-LLM container"):
        return
    engine = json.loads(config_path.read_text())
    pretrained, build = engine.get("pretrained_config", {}), engine.get("build_config", {})
    world = pretrained.get("mapping", {}).get("world_size", 1)
    for rank in range(world):
        report.check((folder / f"rank{rank}.engine").is_file(), name,
                     f"LLM engine rank{rank}.engine is missing (world size {world})")
    limits = to_jsonable(info.profile.limits)
    for key in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
        report.check(build.get(key) == limits[key], name,
                     f"LLM engine {key} is {build.get(key)}, profile {info.profile.name} "
                     f"says {limits[key]}; rebuild the engine")
    report.check(config.max_batch_size <= build.get("max_batch_size", 0), name,
                 f"config max_batch_size {config.max_batch_size} exceeds the engine's "
                 f"{build.get('max_batch_size')}")
    table = next((data_type_name(t.data_type) for t in config.input
                  if t.name == c.PROMPT_EMBEDDING_TABLE), None)
    dtype = pretrained.get("dtype")
    dtype = Dtype(dtype).triton if dtype in tuple(Dtype) else dtype
    report.check(table is not None and table == dtype, name,
                 f"prompt_embedding_table is {table or 'absent'}, the engine computes in "
                 f"{dtype}")
    report.check(world == info.tp_size, name,
                 f"LLM engine has world size {world}, the build says tp_size {info.tp_size}; "
                 "rebuild the engine")
    _check_mrope_engine(name, pretrained, build, report)
    _check_weight_only_engine(name, pretrained, build, info, report)
    for caller, params in callers.items():
        _check_mrope_table(caller, params, name, pretrained, report)
    _check_budgets(name, parameters(config), pretrained, build, info, report)


def _check_mrope_engine(name: str, pretrained: dict[str, Any], build: dict[str, Any],
                        report: ValidationReport) -> None:
    """The attention plugin reads the MRoPE table only on its fused context path (FMHA),
    which exists for fp16/bf16 alone, and not with StreamingLLM (attentionOp.cpp); elsewhere
    image tokens rotate at 1-D positions while text still looks right. The keys are those of
    TensorRT-LLM's PluginConfig (tensorrt_llm/plugin/plugin.py) as engine.save writes them."""
    plugins = build.get("plugin_config", {})
    rebuild = "rebuild the engine with `qvl-trt build --force --only llm`"
    report.check(pretrained.get("dtype") in FUSED_ATTENTION_DTYPES, name,
                 f"LLM engine dtype is {pretrained.get('dtype')}: MRoPE needs fused context "
                 f"attention, which exists for {'/'.join(FUSED_ATTENTION_DTYPES)} only; "
                 f"{rebuild}")
    report.check(plugins.get("context_fmha") is True, name,
                 f"LLM engine was built with context_fmha off: MRoPE needs fused context "
                 f"attention; {rebuild}")
    report.check(not plugins.get("streamingllm"), name,
                 f"LLM engine was built with streamingllm: its rope kernel ignores the MRoPE "
                 f"table; {rebuild}")
    # The C++ runtime feeds the MRoPE inputs only with build_config.use_mrope
    # (cpp/tensorrt_llm/runtime/gptJsonConfig.cpp parseBuilderConfig).
    report.check(build.get("use_mrope") is True, name,
                 f"LLM engine was built without use_mrope: the runtime would not feed "
                 f"mrope_rotary_cos_sin; {rebuild}")
    report.check(pretrained.get("position_embedding_type") == "mrope", name,
                 f"LLM engine's position_embedding_type is "
                 f"{pretrained.get('position_embedding_type')}, not mrope: its attention "
                 f"ignores the MRoPE table; {rebuild}")
    positions = pretrained.get("max_position_embeddings")
    report.check(positions == build.get("max_seq_len"), name,
                 f"LLM engine's max_position_embeddings {positions} is not its max_seq_len "
                 f"{build.get('max_seq_len')} (the build makes them equal; below it the rope "
                 f"kernel that ignores the MRoPE table runs); {rebuild}")


def _check_weight_only_engine(name: str, pretrained: dict[str, Any], build: dict[str, Any],
                              info: BuildInfo, report: ValidationReport) -> None:
    """The engine's weights are the build's (`build --weights`: quant_algo W8A16/W4A16 or
    none), and weight-only ones run through the WeightOnlyQuantMatmul plugin in the engine
    dtype: INT4 has no other path, and the Q/DQ fallback for INT8 would read the GEMM-ready
    integers as plain ones (tensorrt_llm/quantization/functional.py weight_only_quant_matmul,
    tensorrt_llm/quantization/layers.py WeightOnlyQuantLinear)."""
    algo = (pretrained.get("quantization") or {}).get("quant_algo")
    rebuild = "rebuild the engine with `qvl-trt build --force --only llm`"
    report.check(algo == info.weights.quant_algo, name,
                 f"LLM engine's quant_algo is {algo}, build.json says weights {info.weights} "
                 f"({info.weights.quant_algo}); {rebuild} or regenerate the repository from "
                 "the build that made it")
    if algo is None:
        return
    plugin = build.get("plugin_config", {}).get("weight_only_quant_matmul_plugin")
    report.check(plugin == pretrained.get("dtype"), name,
                 f"LLM engine is weight-only {algo} but weight_only_quant_matmul_plugin is "
                 f"{plugin}, not its dtype {pretrained.get('dtype')}; {rebuild}")


def _check_mrope_table(caller: str, params: c.PostprocessingParameters, llm: str,
                       pretrained: dict[str, Any], report: ValidationReport) -> None:
    """The MRoPE table `caller` builds for each request (contract mrope_table()) against the
    engine's config. The C++ runtime sizes each request's slot max_position_embeddings x
    rotary_embedding_dim (cpp/tensorrt_llm/runtime/gptJsonConfig.cpp createModelConfig), the
    attention plugin reads a token's row at that stride (unfusedAttentionKernels_2_template.h)
    and rotates generated tokens from rotary_base over head_size: a table built for another
    max_seq_len, head size, rope_theta or T/H/W layout puts image tokens at wrong angles."""
    try:
        table = params.mrope_table()
    except ConfigError as exc:
        report.check(False, caller, str(exc))
        return
    scaling = pretrained.get("rotary_scaling") or {}
    pairs = (  # (our setting, its value, the engine's key, its value)
        ("max_seq_len", table.max_positions, "max_position_embeddings",
         pretrained.get("max_position_embeddings")),
        ("head_dim", table.head_dim, "head_size", pretrained.get("head_size")),
        ("head_dim", table.head_dim, "rotary_embedding_dim",
         pretrained.get("rotary_embedding_dim")),
        ("rope_theta", table.rope_theta, "rotary_base", pretrained.get("rotary_base")),
        ("mrope_section", list(table.mrope_section), "rotary_scaling.mrope_section",
         scaling.get("mrope_section")),
        ("mrope_interleaved", table.mrope_interleaved, "rotary_scaling.mrope_interleaved",
         scaling.get("mrope_interleaved")),
    )
    for ours, value, engine_key, engine_value in pairs:
        report.check(value == engine_value, f"{caller} -> {llm}",
                     f"builds the MRoPE table with {ours} {value}, the LLM engine has "
                     f"{engine_key} {engine_value}: rebuild the engine with `qvl-trt build "
                     "--force --only llm` or regenerate the repository with `qvl-trt repo` "
                     "from the build that made it")


def _check_budgets(name: str, params: dict[str, str], pretrained: dict[str, Any],
                   build: dict[str, Any], info: BuildInfo, report: ValidationReport) -> None:
    """The KV budget, the prompt table (its size, and its elements where lookup_plugin
    indexes them) and the longest prompt against what `qvl-trt repo` planned."""
    engine = EngineLimits.of_build_config(build)
    if parse_bool(params.get("enable_chunked_context", "false")):
        # The executor would turn chunking off with a warning (EngineLimits.chunked).
        report.check(engine.paged_context_fmha, name,
                     "enable_chunked_context needs an engine built with use_paged_context_fmha; "
                     "set it false or rebuild the engine")
        problem = engine.chunking_problem()
        report.check(problem is None, name, f"enable_chunked_context: {problem}")
    else:
        longest = engine.max_input_len(False)
        admitted = info.profile.limits.max_input_len
        report.check(longest >= admitted, name,
                     f"without enable_chunked_context the executor refuses prompts above "
                     f"{longest} tokens (min(max_seq_len - 1, max_num_tokens)), preprocessing "
                     f"admits {admitted}; set enable_chunked_context true")
    tokens = parse_int(params.get("max_tokens_in_paged_kv_cache", "0")) or 0
    report.check(tokens <= info.kv_cache_tokens, name,
                 f"max_tokens_in_paged_kv_cache {tokens} exceeds the planned KV budget "
                 f"{info.kv_cache_tokens} (what is left beside every build's engines); "
                 "regenerate with `qvl-trt repo`")
    rows = build.get("max_prompt_embedding_table_size", 0)
    # Larger than planned would take memory the KV budget counts on.
    report.check(rows == info.prompt_table_rows, name,
                 f"LLM engine's max_prompt_embedding_table_size is {rows}, the plan for its "
                 f"profile says {info.prompt_table_rows} rows; rebuild the engine")
    bound = prompt_table_element_bound(build.get("plugin_config", {}))
    elements = rows * pretrained.get("hidden_size", 0)
    if bound is not None:
        report.check(elements < bound, name,
                     f"LLM engine was built with lookup_plugin, which indexes the prompt table "
                     f"in 32 bits: {rows} rows x hidden {pretrained.get('hidden_size')} = "
                     f"{elements:,} elements reach {bound:,}; rebuild without lookup_plugin "
                     "(`qvl-trt build` leaves it off)")
