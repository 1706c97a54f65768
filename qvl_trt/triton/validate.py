"""`qvl-trt validate REPO`: check a model repository before a server loads it.

Every config parses as a Triton ModelConfig and holds no "${...}" placeholder; every
ensemble step's map matches the producing and consuming models (name, dtype, dims), no step
mixes tensors that came through different decoupled models (Triton refuses that), the BLS
calls (postprocessing -> tensorrt_llm; tensorrt_llm_bls -> preprocessing, vision_encoder,
tensorrt_llm) match the called models' inputs and run as many instances as serve plans for
(the callers KIND_CPU with a count of 1 or more, tensorrt_llm one), and the engines and
weights each model reads exist and agree with the GPU profile and TensorRT edition the
repository was built for (`<ensemble>/1/build.json`) and, for the LLM engine, with the MRoPE
table its callers build.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
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
    MODEL_PY,
    RUNTIME_ZIP,
    TOKENIZER_INFO_NAME,
    TOKENIZER_JSON,
    VERSION,
    VISION_WEIGHTS_NAME,
    BuildInfo,
)
from .options import Flavor
from .pbconfig import (
    CONFIG_FILE,
    data_type_name,
    get_parameter,
    instance_count,
    parameters,
    parse_config,
    pb2,
)
from .tensorrtllm_backend import (
    EngineLimits,
    check_parameters,
    parse_bool,
    parse_float,
    parse_int,
)


@dataclass(frozen=True)
class Problem:
    where: str  # model (or model/file)
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class ValidationReport:
    repo: Path
    models: list[str] = field(default_factory=list)
    checks: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self, ok: bool, where: str, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.problems.append(Problem(where, message))
        return ok


@dataclass(frozen=True)
class _Tensor:
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False


def validate_repo(repo: Path) -> ValidationReport:
    """Check the repository at `repo`; the report lists every problem found."""
    repo = Path(repo)
    if not repo.is_dir():
        raise ConfigError(f"{repo} is not a folder; pass the model repository `qvl-trt repo` "
                          "wrote")
    report = ValidationReport(repo)
    configs = _read_configs(repo, report)
    report.models = sorted(configs)
    report.check(bool(configs), str(repo), "holds no model")
    callers: dict[str, c.PostprocessingParameters] = {}  # model -> how it calls tensorrt_llm
    for name, config in configs.items():
        if config.platform == "ensemble":
            _check_ensemble(name, config, configs, report)
        if config.backend == "python":
            _check_python_model(repo / name, name, report)
        if config.backend == "tensorrtllm":
            _check_tensorrtllm_parameters(name, config, report)
        caller = _llm_caller(name, config, report)
        if caller is not None:
            _check_llm_call(name, _llm_inputs_sent(name, caller, config, configs, report),
                            caller.tensorrt_llm_model, configs, report)
            _check_caller_instances(name, config, report)
            callers[name] = caller
    for llm in sorted({p.tensorrt_llm_model for p in callers.values()} & configs.keys()):
        # Each instance would load its own executor: engine and KV cache (the plan has one).
        report.check(instance_count(configs[llm]) == 1, llm,
                     f"runs {instance_count(configs[llm])} instances, each with its own engine "
                     "and KV cache (the plan holds one); write an instance count of 1")
        _check_admission(llm, configs[llm], {n: p for n, p in callers.items()
                                              if p.tensorrt_llm_model == llm}, report)
    for name, config in configs.items():
        if config.platform == "ensemble":
            _check_guide_mapped(name, config, callers, report)
            _check_artifacts(repo, name, configs, callers, report)
    return report


def _check_admission(llm: str, config: Any, callers: dict[str, c.PostprocessingParameters],
                     report: ValidationReport) -> None:
    """The callers of `llm` admit requests to its batch (runtime/admission.py): their slots
    are its max_batch_size (more would queue in the executor, out of sight and without
    bound; fewer would leave slots idle), and they share one queue, so they agree on it."""
    for name, params in callers.items():
        report.check(params.batch_slots == config.max_batch_size, name,
                     f"batch_slots is {params.batch_slots}, {llm}'s max_batch_size is "
                     f"{config.max_batch_size}: they must be equal; regenerate with "
                     "`qvl-trt repo`")
    queues = {(p.max_queue, p.max_queue_wait_s) for p in callers.values()}
    report.check(len(queues) <= 1, llm, f"its callers {', '.join(sorted(callers))} differ in "
                 "max_queue or max_queue_wait_s, though they share one queue; regenerate "
                 "with `qvl-trt repo`")


def _check_guide_mapped(name: str, config: Any, callers: dict[str, c.PostprocessingParameters],
                        report: ValidationReport) -> None:
    """The ensemble takes the guide and the probe flag and hands them, as they came, to its
    step that calls tensorrt_llm."""
    inputs = _inputs(config)
    for key in c.FROM_PUBLIC:
        report.check(key in inputs, name, f"has no input {key}: clients cannot send it (a "
                     "guide for guided decoding, or serve's health probe); regenerate with "
                     "`qvl-trt repo`")
    for step in config.ensemble_scheduling.step:
        if step.model_name in callers:
            for key in c.FROM_PUBLIC:
                report.check(step.input_map.get(key) == key, f"{name} -> {step.model_name}",
                             f"does not map the ensemble input {key} to {key}: what a client "
                             "sends in it would be dropped; regenerate with `qvl-trt repo`")


# ---- configs ------------------------------------------------------------------------------

def _read_configs(repo: Path, report: ValidationReport) -> dict[str, Any]:
    configs = {}
    for folder in sorted(p for p in repo.iterdir() if p.is_dir()):
        name = folder.name
        path = folder / CONFIG_FILE
        if not report.check(path.is_file(), name, f"no {CONFIG_FILE}: Triton loads every "
                            "folder of the repository as a model; remove it or regenerate"):
            continue
        text = path.read_text()
        report.check("${" not in text, f"{name}/{CONFIG_FILE}",
                     "holds an unfilled ${...} placeholder; regenerate with `qvl-trt repo`")
        try:
            config = parse_config(text, f"{name}/{CONFIG_FILE}")
        except ConfigError as exc:
            report.check(False, f"{name}/{CONFIG_FILE}", str(exc))
            continue
        report.check(config.name in ("", name), name,
                     f"config names the model {config.name!r}, its folder is {name!r}")
        report.check((folder / VERSION).is_dir(), name, f"has no version folder {VERSION}/")
        configs[name] = config
    return configs


def _inputs(config: Any) -> dict[str, _Tensor]:
    return {i.name: _Tensor(data_type_name(i.data_type), tuple(i.dims), i.optional)
            for i in config.input}


def _outputs(config: Any) -> dict[str, _Tensor]:
    return {o.name: _Tensor(data_type_name(o.data_type), tuple(o.dims)) for o in config.output}


def _dims_match(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _same_tensor(report: ValidationReport, where: str, what: str, produced: _Tensor,
                 consumed: _Tensor) -> None:
    report.check(produced.data_type == consumed.data_type, where,
                 f"{what}: dtype {produced.data_type} is produced, {consumed.data_type} expected")
    report.check(_dims_match(produced.dims, consumed.dims), where,
                 f"{what}: dims {list(produced.dims)} are produced, {list(consumed.dims)} "
                 "expected")


# ---- ensembles ------------------------------------------------------------------------------

def _check_ensemble(name: str, config: Any, configs: dict[str, Any],
                    report: ValidationReport) -> None:
    # tensor -> (what it is, the decoupled model it came through or None)
    produced: dict[str, tuple[_Tensor, str | None]] = {
        t: (spec, None) for t, spec in _inputs(config).items()}
    steps = list(config.ensemble_scheduling.step)
    report.check(bool(steps), name, "ensemble has no steps")
    pending = list(steps)
    while pending:  # a step runs when its inputs exist, whatever the order they are listed in
        ready = [s for s in pending if all(t in produced for t in s.input_map.values())]
        if not ready:
            for step in pending:
                missing = sorted(t for t in step.input_map.values() if t not in produced)
                report.check(False, name, f"step {step.model_name} reads {', '.join(missing)}, "
                             "which no input or step produces")
            return
        for step in ready:
            pending.remove(step)
            _check_step(name, config, step, configs, produced, report)
    for out, spec in _outputs(config).items():
        if report.check(out in produced, name, f"output {out} is produced by no step"):
            _same_tensor(report, name, f"output {out}", produced[out][0], spec)


def _check_step(ensemble: str, config: Any, step: Any, configs: dict[str, Any],
                produced: dict[str, tuple[_Tensor, str | None]],
                report: ValidationReport) -> None:
    model = step.model_name
    where = f"{ensemble} -> {model}"
    target = configs.get(model)
    if not report.check(target is not None, ensemble, f"step model {model} is not in the "
                        "repository"):
        for tensor in step.output_map.values():
            produced[tensor] = (_Tensor("", ()), None)
        return
    report.check(config.max_batch_size <= target.max_batch_size, where,
                 f"max_batch_size {target.max_batch_size} is below the ensemble's "
                 f"{config.max_batch_size}")
    inputs, outputs = _inputs(target), _outputs(target)
    origins = set()
    for key, tensor in step.input_map.items():
        spec, origin = produced[tensor]
        origins.add(origin)
        if report.check(key in inputs, where, f"maps {tensor} to {key}, which is not an input "
                        f"of {model}"):
            _same_tensor(report, where, f"{tensor} -> {key}", spec, inputs[key])
            report.check(not spec.optional or inputs[key].optional, where,
                         f"optional ensemble input {tensor} feeds required input {key}")
    for key, spec in inputs.items():
        report.check(key in step.input_map or spec.optional, where,
                     f"required input {key} is not mapped")
    sources = ", ".join(sorted(o or "the ensemble inputs" for o in origins))
    report.check(len(origins) <= 1, where, "reads tensors that came through different "
                 f"decoupled models ({sources}); Triton refuses such an ensemble")
    origin = model if target.model_transaction_policy.decoupled else next(iter(origins), None)
    for key, tensor in step.output_map.items():
        if not report.check(key in outputs, where, f"maps output {key}, which {model} does not "
                            "have"):
            continue
        report.check(tensor not in produced, where, f"tensor {tensor} is produced twice")
        produced[tensor] = (outputs[key], origin)


def _llm_caller(name: str, config: Any,
                report: ValidationReport) -> c.PostprocessingParameters | None:
    """The parameters of a model that runs tensorrt_llm, as its model.py reads them."""
    try:
        return c.llm_caller_parameters(parameters(config), f"{name} parameters")
    except ConfigError as exc:
        report.check(False, name, f"{exc}; regenerate the repository with `qvl-trt repo`")
        return None


def _llm_inputs_sent(name: str, caller: c.PostprocessingParameters, config: Any,
                     configs: dict[str, Any], report: ValidationReport) -> dict[str, _Tensor]:
    """What a model sends tensorrt_llm: postprocessing its inputs; tensorrt_llm_bls (it names
    the steps it runs first) those steps' outputs, after its inputs went to preprocessing."""
    if not isinstance(caller, c.TensorrtLlmBlsParameters):
        return _built_before_call(name, _inputs(config), report)
    steps = [caller.preprocessing_model, caller.vision_encoder_model]
    sent, outputs = _inputs(config), {}
    for step in steps:
        target = configs.get(step)
        if not report.check(target is not None, name, f"calls {step}, which is not in the "
                            "repository"):
            return {}
        for key, spec in _inputs(target).items():
            have = sent.get(key, outputs.get(key))
            if report.check(have is not None or spec.optional, f"{name} -> {step}",
                            f"required input {key} is not sent") and have is not None:
                _same_tensor(report, f"{name} -> {step}", key, have, spec)
        outputs |= _outputs(target)
        sent = {}
    received = {s.name: outputs[s.name] for s in c.POSTPROCESSING_INPUTS if s.name in outputs}
    own = _inputs(config)  # the guide comes from its own inputs (runtime/tensorrt_llm_bls.py)
    received |= {key: own[key] for key in c.FROM_PUBLIC if key in own}
    return _built_before_call(name, received, report)


def _built_before_call(name: str, received: dict[str, _Tensor],
                       report: ValidationReport) -> dict[str, _Tensor]:
    """What a caller sends tensorrt_llm of the tensors it received: it builds the MRoPE table
    from the position ids (runtime/llm_inputs.py), which must be the contract's, and keeps
    what it reads itself (the probe flag)."""
    sent = {key: t for key, t in received.items() if key not in c.TAKEN_BY_CALLER}
    specs = {s.name: s for s in c.LLM_INPUTS + c.PREPROCESSING_OUTPUTS}
    for built, source in c.BUILT_FOR_LLM.items():
        have = sent.pop(source, None)
        if have is not None:
            want = specs[source]
            _same_tensor(report, name, source, have, _Tensor(want.data_type, want.dims))
            sent[built] = _Tensor(specs[built].data_type, specs[built].dims)
    return sent


def _check_llm_call(name: str, ours: dict[str, _Tensor], llm: str, configs: dict[str, Any],
                    report: ValidationReport) -> None:
    """`ours` (what `name` sends tensorrt_llm) must be the LLM's inputs."""
    where = f"{name} -> {llm}"
    target = configs.get(llm)
    if not report.check(target is not None, name, f"calls {llm}, which is not in the "
                        "repository"):
        return
    theirs = _inputs(target)
    for key, spec in ours.items():
        if report.check(key in theirs, where, f"forwards {key}, which is not an input of {llm}"):
            _same_tensor(report, where, key, spec, theirs[key])
    for key, spec in theirs.items():
        report.check(key in ours or spec.optional, where,
                     f"required input {key} of {llm} is not forwarded")
    # A guide a caller does not pass on is dropped: the client gets an unguided answer.
    for spec in c.GUIDE_INPUTS:
        report.check(spec.name in ours, where, f"does not forward {spec.name}: a client's "
                     "guide would be dropped and the answer unguided; regenerate with "
                     "`qvl-trt repo`")
    # Optional in the backend's config, but an engine with use_mrope refuses a request
    # without them (text-only ones too).
    for key in (c.MROPE_ROTARY_COS_SIN, c.MROPE_POSITION_DELTAS):
        report.check(key in ours, where, f"does not send {key}: the engine uses MRoPE and "
                     f"{llm} needs it on every request; regenerate with `qvl-trt repo`")
    report.check(bool(target.model_transaction_policy.decoupled), where,
                 f"{llm} must be decoupled (it is called for a token stream)")


def _check_caller_instances(name: str, config: Any, report: ValidationReport) -> None:
    """A model that runs tensorrt_llm has the instances the writer makes (KIND_CPU, a count
    of 1 or more), which serve sizes the BLS threads by."""
    kind_cpu = pb2().ModelInstanceGroup.Kind.Value("KIND_CPU")
    for group in config.instance_group:
        report.check(group.count >= 1 and group.kind == kind_cpu, name,
                     f"instance group of count {group.count}, "
                     f"{pb2().ModelInstanceGroup.Kind.Name(group.kind)}: write KIND_CPU and a "
                     "count of 1 or more (`qvl-trt repo --postprocessing-instances N`); serve "
                     "sizes the BLS threads by it, and Triton would multiply a KIND_GPU count "
                     "by the GPUs")


# The iteration counter set at least this often: serve's stall timeout (a minute by default)
# then sees it move several times.
MAX_STATS_PERIOD_MS = 10_000


def _check_tensorrtllm_parameters(name: str, config: Any, report: ValidationReport) -> None:
    """The parameters as the stock backend parses them, then what this pipeline needs of
    them."""
    params = parameters(config)
    problems = check_parameters(params)
    for problem in problems:
        report.check(False, name, problem)
    if problems:
        return
    # postprocessing detokenizes every token it receives: the prompt must not come back.
    report.check(parse_bool(params.get("exclude_input_in_output", "false")) is True, name,
                 "exclude_input_in_output must be true: postprocessing treats every returned "
                 "token as generated text")
    report.check(params.get("max_beam_width", "1").strip() == "1", name,
                 f"max_beam_width is {params.get('max_beam_width')}: postprocessing reads one "
                 "beam; set 1")
    tokens = parse_int(params.get("max_tokens_in_paged_kv_cache", "0")) or 0
    report.check(tokens > 0, name,
                 "max_tokens_in_paged_kv_cache is not set: the KV cache would take "
                 "kv_cache_free_gpu_mem_fraction of the memory free when it loads, racing the "
                 "vision engine; regenerate with `qvl-trt repo` (it sets the planner's budget)")
    fraction = parse_float(params.get("kv_cache_free_gpu_mem_fraction", "0.9"))
    report.check(fraction is not None and 0 < fraction <= 1, name,
                 f"kv_cache_free_gpu_mem_fraction is {fraction}; it must be in (0, 1]")
    # serve tells busy from wedged by the iteration counter the backend sets from the
    # executor's iteration stats every stats_check_period_ms (serve/progress.py): with none
    # kept, or set rarely, a server busy with long answers looks stalled and is restarted.
    kept = parse_int(params.get("iter_stats_max_iterations", "1000"))
    report.check(kept is not None and kept > 0, name,
                 f"iter_stats_max_iterations is {kept}: the executor then keeps no iteration "
                 "stats and the backend's iteration counter never moves, which serve reads as "
                 "no progress; leave it out (1000) or set it above 0")
    period = parse_int(params.get("stats_check_period_ms", "100"))
    report.check(period is not None and 0 < period <= MAX_STATS_PERIOD_MS, name,
                 f"stats_check_period_ms is {period}: serve reads the iteration counter as "
                 f"progress and needs it set at least every {MAX_STATS_PERIOD_MS} ms (its stall "
                 "timeout is a minute); leave it out (100)")


# ---- files ----------------------------------------------------------------------------------

def _check_python_model(folder: Path, name: str, report: ValidationReport) -> None:
    version = folder / VERSION
    report.check((version / MODEL_PY).is_file(), name, f"{VERSION}/{MODEL_PY} is missing")
    runtime = version / RUNTIME_ZIP
    ok = runtime.is_file() and zipfile.is_zipfile(runtime)
    if ok:
        with zipfile.ZipFile(runtime) as zf:
            ok = "qvl_trt/__init__.py" in zf.namelist()
    report.check(ok, name, f"{VERSION}/{RUNTIME_ZIP} is missing or not the qvl_trt runtime; "
                 "regenerate with `qvl-trt repo`")


def _check_artifacts(repo: Path, ensemble: str, configs: dict[str, Any],
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
    table = _inputs(config).get("prompt_embedding_table")
    dtype = pretrained.get("dtype")
    dtype = Dtype(dtype).triton if dtype in tuple(Dtype) else dtype
    report.check(table is not None and table.data_type == dtype, name,
                 f"prompt_embedding_table is {table.data_type if table else 'absent'}, the "
                 f"engine computes in {dtype}")
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
