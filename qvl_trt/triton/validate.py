"""`qvl-trt validate REPO`: check a model repository before a server loads it.

Every config parses as a Triton ModelConfig and holds no "${...}" placeholder; every
ensemble step's map matches the producing and consuming models (name, dtype, dims), no step
mixes tensors that came through different decoupled models (Triton refuses that), the BLS
calls (postprocessing -> tensorrt_llm; tensorrt_llm_bls -> preprocessing, vision_encoder,
tensorrt_llm) match the called models' inputs and run as many instances as serve plans for
(the callers KIND_CPU with a count of 1 or more, tensorrt_llm one), tensorrt_llm's parameters
are what the stock backend parses and this pipeline needs, and every python model has its
model.py and runtime. Then validate_artifacts.py checks the engines, weights and tokenizer
files the configs point at against the build that wrote the repository.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import contract as c
from .layout import MODEL_PY, RUNTIME_ZIP, VERSION
from .pbconfig import (
    CONFIG_FILE,
    data_type_name,
    instance_count,
    parameters,
    parse_config,
    pb2,
)
from .tensorrtllm_backend import check_parameters, parse_bool, parse_float, parse_int
from .validate_artifacts import check_artifacts
from .validation_report import ValidationReport


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
            check_artifacts(repo, name, configs, callers, report)
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
