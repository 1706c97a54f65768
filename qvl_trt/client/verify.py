"""`qvl-trt verify`: send the same greedy requests to a deployment and to a reference (the
in-process reference pipeline, or a second deployment), compare the generated token ids case
by case and report the first divergence.

Token ids are read from the deployment's LLM model itself: the ensemble's steps are called
one by one over gRPC, in the order and with the tensor wiring the server's own ensemble config
states, up to the step fed with the LLM's inputs (the LLM step, or a model driving it); the
LLM model then gets those tensors directly. So the comparison sees exactly what the engine
generated, before detokenization.
"""

from __future__ import annotations

import contextlib
import json
import queue
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..deps import require
from ..errors import ConfigError, InputError, RequestError
from ..llm.agreement import first_divergence
from ..triton import contract as c
from .generate import GenerateClient, GenerateRequest, ensemble_request


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    images: tuple[Path, ...] = ()
    max_tokens: int = 16
    must_match: int | None = None  # leading tokens that must agree; None: all of them
    videos: tuple[Path, ...] = ()  # video files, after the images
    video_fps: float | None = None

    def request(self) -> GenerateRequest:
        return GenerateRequest(self.prompt, tuple(p.read_bytes() for p in self.images),
                               max_tokens=self.max_tokens, temperature=0.0, stream=True,
                               videos=tuple(p.read_bytes() for p in self.videos),
                               video_fps=self.video_fps)


@dataclass(frozen=True)
class CaseResult:
    name: str
    reference: tuple[int, ...]
    candidate: tuple[int, ...]
    must_match: int  # tokens that had to agree
    first_divergence: int | None  # index of the first differing token; None: identical

    @property
    def passed(self) -> bool:
        return self.first_divergence is None or self.first_divergence >= self.must_match


_CASE_KEYS = {"name", "prompt", "images", "videos", "video_fps", "max_tokens", "must_match"}


def load_cases(path: Path) -> list[Case]:
    """A JSON list of cases (or `{"cases": [...]}`), or JSON lines; image and video paths are
    relative to the file. Each case: name, prompt, images (list), videos (list), video_fps,
    max_tokens, must_match."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError(f"--cases {path}: cannot read it ({exc.strerror})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise InputError(f"--cases {path}: not JSON or JSON lines ({exc.msg} at line "
                             f"{exc.lineno})") from None
    if isinstance(data, dict):
        data = data.get("cases")
    if not isinstance(data, list) or not data:
        raise InputError(f"--cases {path}: expected a non-empty list of cases")
    cases = []
    for n, raw in enumerate(data, 1):
        where = f"--cases {path}, case {n}"
        if not isinstance(raw, dict) or not isinstance(raw.get("prompt"), str):
            raise InputError(f"{where}: each case is an object with a prompt string")
        unknown = set(raw) - _CASE_KEYS
        if unknown:
            raise InputError(f"{where}: unknown keys {sorted(unknown)}; allowed: "
                             f"{sorted(_CASE_KEYS)}")
        images = tuple(path.parent / p for p in raw.get("images", []))
        videos = tuple(path.parent / p for p in raw.get("videos", []))
        for kind, files in (("image", images), ("video", videos)):
            missing = [str(p) for p in files if not p.is_file()]
            if missing:
                raise InputError(f"{where}: {kind} {missing[0]} does not exist")
        video_fps = raw.get("video_fps")
        if video_fps is not None and (isinstance(video_fps, bool) or
                                      not isinstance(video_fps, (int, float)) or
                                      not 0 < video_fps < float("inf")):
            raise InputError(f"{where}: video_fps must be a number above 0")
        max_tokens, must_match = raw.get("max_tokens", 16), raw.get("must_match")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise InputError(f"{where}: max_tokens must be an integer >= 1")
        if must_match is not None and (not isinstance(must_match, int) or must_match < 0):
            raise InputError(f"{where}: must_match must be an integer >= 0")
        cases.append(Case(str(raw.get("name", f"case {n}")), raw["prompt"], images,
                          max_tokens, must_match, videos,
                          None if video_fps is None else float(video_fps)))
    return cases


def compare(case: Case, reference: Sequence[int], candidate: Sequence[int],
            must_match: int | None) -> CaseResult:
    """`must_match` (the command's default, overridden by the case's): None = all tokens."""
    required = case.must_match if case.must_match is not None else must_match
    if required is None:
        required = max(len(reference), len(candidate))
    return CaseResult(case.name, tuple(reference), tuple(candidate), required,
                      first_divergence(reference, candidate))


Side = Callable[[GenerateRequest], list[int]]  # a request -> its greedy token ids


def verify(cases: Sequence[Case], reference: Side, candidate: Side, *,
           must_match: int | None = None,
           on_case: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Run every case on both sides and compare."""
    results = []
    for case in cases:
        req = case.request()
        result = compare(case, reference(req), candidate(req), must_match)
        results.append(result)
        if on_case:
            on_case(result)
    return results


@contextlib.contextmanager
def open_sides(url: str, against: str, *, served_model: str = c.ENSEMBLE,
               model: Path | None = None, llm_checkpoint: Path | None = None) \
        -> Iterator[tuple[Side, StepwiseDeployment]]:
    """(reference, candidate) for `verify`, closed on exit: the candidate is the deployment
    at `url`; `against` is `reference` (the in-process pipeline on the HF checkpoint `model`,
    with the deployment's request limits) or a second deployment's URL."""
    with contextlib.ExitStack() as stack:
        candidate = stack.enter_context(contextlib.closing(StepwiseDeployment(
            url, model=served_model)))
        if against == "reference":
            if model is None:
                raise ConfigError("--against reference needs --model (the deployment's HF "
                                  "checkpoint)")
            reference: Side = InProcessReference(model, limits=candidate.client.request_limits(),
                                                 llm_checkpoint=llm_checkpoint)
        else:
            reference = stack.enter_context(contextlib.closing(StepwiseDeployment(
                against, model=served_model)))
        yield reference, candidate


def verify_deployment(cases: Path, url: str, against: str, *, served_model: str = c.ENSEMBLE,
                      model: Path | None = None, llm_checkpoint: Path | None = None,
                      must_match: int | None = None,
                      on_case: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """`qvl-trt verify`: the cases file `cases` run on the deployment at `url` and on
    `against` (`open_sides`), compared."""
    case_list = load_cases(cases)
    with open_sides(url, against, served_model=served_model, model=model,
                    llm_checkpoint=llm_checkpoint) as (reference, candidate):
        return verify(case_list, reference, candidate, must_match=must_match, on_case=on_case)


class StepwiseDeployment:
    """Greedy token ids from a deployment, read at its LLM step (see the module docstring)."""

    def __init__(self, url: str, *, model: str = c.ENSEMBLE, timeout_s: float = 600.0) -> None:
        self.client = GenerateClient(url, model=model, timeout_s=timeout_s)
        if self.client.endpoint.protocol != "grpc":
            raise InputError(f"verify reads the LLM step over gRPC; pass grpc://HOST:PORT, not "
                             f"{url}")
        self.timeout_s = timeout_s
        scheduling = self.client.model_config(model).get("ensemble_scheduling")
        if not scheduling:
            raise InputError(f"{model} on {url} is not an ensemble; pass --served-model")
        self.steps = scheduling["step"]
        names = c.ModelNames() if model == c.ENSEMBLE else c.ModelNames.for_build(model)
        self.llm_model = names.tensorrt_llm
        # The MRoPE table postprocessing builds before each call, built the same way here.
        self.mrope = c.PostprocessingParameters.from_parameters(c.config_parameters(
            self.client.model_config(names.postprocessing)), names.postprocessing).mrope_table()

    def close(self) -> None:
        self.client.close()

    def __call__(self, req: GenerateRequest) -> list[int]:
        tensors = ensemble_request(req).to_tensors()
        llm_inputs = {s.name for s in c.LLM_INPUTS}
        required = {s.name for s in c.LLM_INPUTS if not s.optional}
        for step in self._ordered_steps():
            if required <= set(step["input_map"]):
                # The step that feeds the LLM (the LLM itself, or a model driving it): the
                # LLM model gets those tensors directly.
                wiring = {k: v for k, v in step["input_map"].items() if k in llm_inputs}
                positions = tensors[step["input_map"][c.MROPE_POSITION_IDS]]
                tensors[c.MROPE_ROTARY_COS_SIN] = self.mrope(positions[0])[None]
                wiring[c.MROPE_ROTARY_COS_SIN] = c.MROPE_ROTARY_COS_SIN
                ids = self._generate(self.llm_model, self._inputs(wiring, tensors))
                end = tensors.get(wiring.get(c.END_ID, ""))
                if end is not None and int(end.reshape(-1)[0]) in ids:
                    ids = ids[: ids.index(int(end.reshape(-1)[0]))]
                return ids
            outputs = self._infer(step["model_name"], self._inputs(step["input_map"], tensors),
                                  list(step["output_map"]))
            for model_output, ensemble_name in step["output_map"].items():
                tensors[ensemble_name] = outputs[model_output]
        raise RequestError(f"no step of {self.client.model} takes the LLM's inputs")

    def _ordered_steps(self) -> list[dict[str, Any]]:
        """The steps in an order where each comes after those producing its inputs (the
        config lists them in any order)."""
        pending, ordered, produced = list(self.steps), [], set()
        made_by_steps = {t for step in self.steps for t in step["output_map"].values()}
        while pending:
            ready = next((step for step in pending if all(
                t in produced or t not in made_by_steps for t in step["input_map"].values())),
                None)
            if ready is None:
                raise RequestError(f"the steps of {self.client.model} form a cycle")
            pending.remove(ready)
            ordered.append(ready)
            produced |= set(ready["output_map"].values())
        return ordered

    def _inputs(self, input_map: dict[str, str], tensors: dict[str, np.ndarray]) -> list:
        grpc = require("tritonclient.grpc", extra="serve", why="call Triton over gRPC")
        utils = require("tritonclient.utils", extra="serve", why="call Triton over gRPC")
        inputs = []
        for model_input, ensemble_name in input_map.items():
            value = tensors.get(ensemble_name)
            if value is None:
                continue  # an optional input the request left out
            dtype = "BYTES" if value.dtype == object else utils.np_to_triton_dtype(value.dtype)
            tensor = grpc.InferInput(model_input, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        return inputs

    def _infer(self, model: str, inputs: list, outputs: list[str]) -> dict[str, np.ndarray]:
        grpc = require("tritonclient.grpc", extra="serve", why="call Triton over gRPC")
        try:
            result = self.client.grpc_client().infer(
                model, inputs, outputs=[grpc.InferRequestedOutput(n) for n in outputs],
                client_timeout=self.timeout_s)
        except Exception as exc:  # tritonclient's InferenceServerException
            raise RequestError(f"{model}: {' '.join(str(exc).split())}") from None
        return {name: result.as_numpy(name) for name in outputs}

    def _generate(self, model: str, inputs: list) -> list[int]:
        """The decoupled LLM step over its own stream: new ids of every response, in order."""
        grpc = require("tritonclient.grpc", extra="serve", why="call Triton over gRPC")
        client = grpc.InferenceServerClient(self.client.endpoint.address)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        ids: list[int] = []
        try:
            client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex,
                                      enable_empty_final_response=True)
            while True:
                try:
                    result, error = responses.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise RequestError(f"{model}: no response within {self.timeout_s:.0f} s") \
                        from None
                if error is not None:
                    raise RequestError(f"{model}: {' '.join(str(error).split())}")
                out = result.as_numpy(c.OUTPUT_IDS)
                if out is not None and out.size:
                    ids += [int(t) for t in out.reshape(-1, out.shape[-1])[0]]  # beam 0
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return ids
        finally:
            client.stop_stream()
            client.close()


class InProcessReference:
    """Greedy token ids from the in-process reference pipeline (PyTorch), preprocessing with
    the deployment's request limits so both sides see the same image sizes."""

    def __init__(self, model: Path, *, limits: c.PreprocessingParameters,
                 llm_checkpoint: Path | None = None, device: str = "cpu") -> None:
        from ..llm.pipeline import ReferencePipeline
        from ..mm.request import RequestLimits

        self.pipeline = ReferencePipeline.load(model, checkpoint=llm_checkpoint, device=device,
                                               max_seq_len=limits.max_seq_len,
                                               limits=RequestLimits.from_fields(limits))
        # The deployment's end id (generation_config's first eos), cut as the backend does.
        self.end_id = self.pipeline.checkpoint.generation.end_ids[0]

    def __call__(self, req: GenerateRequest) -> list[int]:
        from ..chat_messages import VideoFile
        from ..llm.sampling import SamplingParams

        out = self.pipeline.ask(req.prompt, list(req.images),
                                sampling=SamplingParams(max_tokens=req.max_tokens, greedy=True),
                                videos=[VideoFile(v, req.video_fps) for v in req.videos])
        ids = list(out.token_ids)
        return ids[: ids.index(self.end_id)] if self.end_id in ids else ids


def checkpoint_agreement(cases: Sequence[Case], model: Path, baseline: Path, candidate: Path,
                         *, device: str = "cpu"):
    """The greedy tokens and logits of two converted checkpoints of `model` (e.g. a build's
    fp16 llm_checkpoint and a `--weights int8` one) on the same cases, both run by the
    reference decoder in process (qvl_trt.llm.agreement.Agreement)."""
    from ..chat_messages import VideoFile, user_message
    from ..llm.agreement import compare_decoders
    from ..llm.pipeline import ReferencePipeline
    from ..llm.reference import ReferenceDecoder
    from ..llm.sampling import SamplingParams

    pipeline = ReferencePipeline.load(model, checkpoint=baseline, device=device)
    decoder = pipeline.decoder
    other = ReferenceDecoder.load(candidate, device=device,
                                  dtype=str(decoder.dtype).removeprefix("torch."))
    requests = []
    for case in cases:
        _, request = pipeline.prepare(
            user_message(case.prompt, len(case.images), len(case.videos)),
            [p.read_bytes() for p in case.images],
            sampling=SamplingParams(max_tokens=case.max_tokens, greedy=True),
            videos=[VideoFile(p.read_bytes(), case.video_fps) for p in case.videos])
        requests.append((case.name, request))
    return compare_decoders(decoder, other, requests)
