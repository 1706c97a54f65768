"""What serving a repository takes (`ServeNeeds`, `read_needs`), read from its files before a
server starts: the MPI world size of its TensorRT-LLM engines, the python backend's BLS
threads, shared memory, and the TensorRT edition of each vision engine. `resolve_world_size`
and `check_vision_editions` refuse what would fail only after the server started (or, worse,
serve wrong answers), `warn_small_shm` warns; `serve_checks` makes the same checks as the rows
of `qvl-trt doctor --repo`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import ConfigError, QvlError
from ..manifest import CONFIG_NAME, VISION_ENGINE_NAME
from ..profiles import TrtEdition
from ..triton.contract import llm_caller_parameters
from ..triton.layout import BUILD_INFO, ENGINE_DIR, TOKENIZER_INFO_NAME, VERSION, BuildInfo
from ..triton.pbconfig import (
    CONFIG_FILE,
    get_parameter,
    instance_count,
    parameters,
    parse_config,
    read_config,
    set_parameters,
    write_config,
)
from .server import DEFAULT_THREAD_POOL, SHM_DIR

log = logging.getLogger(__name__)

# Threads beyond the BLS callers' (the non-decoupled BLS calls of the models themselves).
THREAD_POOL_MARGIN = 8


def shm_gib(nbytes: int) -> int:
    """Whole GiB of shared memory holding at least `nbytes` (1 at least)."""
    return max(1, -(-nbytes // 2**30))


def shm_flag(nbytes: int) -> str:
    """A docker --shm-size value of at least `nbytes`, in whole GiB."""
    return f"{shm_gib(nbytes)}g"


@dataclass(frozen=True)
class ServeNeeds:
    repo: Path
    llm_models: tuple[str, ...]  # tensorrtllm-backend models
    engine_world_sizes: dict[str, int]  # LLM model -> its engine's mapping.world_size
    # concurrent BLS callers: the requests each build's tensorrt_llm admits (its batch slots,
    # queue places and probe: every instance of its callers shares them)
    bls_callers: int
    shm_bytes: int  # shared memory the builds' largest requests need in flight
    vision_editions: dict[str, TrtEdition]  # vision_encoder model -> its engine's edition
    ensembles: tuple[str, ...] = ()  # the models clients call (serve's end-to-end probe)
    builds: tuple[BuildInfo, ...] = ()  # what each build holds (its GPU profile, its flavor)
    # python-backend model -> its instances, each a stub process
    instances: dict[str, int] = field(default_factory=dict)
    engine_bytes: int = 0  # the engines' files, each read into host memory to load

    @property
    def world_size(self) -> int:
        return max(self.engine_world_sizes.values(), default=1)

    @property
    def thread_pool_size(self) -> int:
        return max(DEFAULT_THREAD_POOL, self.bls_callers + THREAD_POOL_MARGIN)


def read_needs(repo: Path) -> ServeNeeds:
    """What serving `repo` takes, from its configs, engine configs and build.json files."""
    repo = Path(repo).resolve()
    llm, worlds, callers, editions, ensembles, builds, instances = [], {}, {}, {}, [], [], {}
    engine_bytes = 0
    for path in sorted(repo.glob(f"*/{CONFIG_FILE}")):
        name = path.parent.name
        config = parse_config(path.read_text(), str(path))
        version = path.parent / VERSION
        if config.platform == "ensemble":
            ensembles.append(name)
        if config.backend == "tensorrtllm":
            llm.append(name)
            worlds[name] = _engine_world_size(version / ENGINE_DIR)
        caller = llm_caller_parameters(parameters(config), str(path))
        if caller is not None:  # each admitted request holds one BLS call at a time
            callers[caller.tensorrt_llm_model] = max(callers.get(caller.tensorrt_llm_model, 0),
                                                     caller.workers)
        vision = version / ENGINE_DIR / CONFIG_NAME
        if config.backend == "python":
            instances[name] = instance_count(config)
            if vision.is_file() and (version / ENGINE_DIR / VISION_ENGINE_NAME).is_file():
                editions[name] = TrtEdition(json.loads(vision.read_text())["edition"])
        engine_bytes += sum(f.stat().st_size for f in (version / ENGINE_DIR).rglob("*")
                            if f.is_file())
        info = version / BUILD_INFO
        if info.is_file():
            builds.append(BuildInfo.read(info))
    return ServeNeeds(repo, tuple(llm), worlds, sum(callers.values()),
                     sum(b.shm_bytes for b in builds),
                     editions, tuple(ensembles), tuple(builds), instances, engine_bytes)


def _engine_world_size(engine: Path) -> int:
    path = engine / CONFIG_NAME
    if not path.is_file():
        return 1  # validate reports the missing engine; the server would fail to load it
    return int(json.loads(path.read_text())["pretrained_config"]["mapping"]["world_size"])


def point_engine_paths(needs: ServeNeeds) -> list[str]:
    """Re-point each tensorrtllm model's gpt_model_path at its engine folder, and its
    xgrammar_tokenizer_info_path at its tokenizer info, inside the repository when it was
    moved or copied (the backend takes only absolute paths). Returns the models changed."""
    repo = needs.repo
    changed = []
    for name in needs.llm_models:
        config = read_config(repo / name)
        version = repo / name / VERSION
        # An empty xgrammar_tokenizer_info_path is guided decoding turned off: left so.
        paths = {key: path for key, path, off in (
            ("gpt_model_path", version / ENGINE_DIR, None),
            ("xgrammar_tokenizer_info_path", version / TOKENIZER_INFO_NAME, ""))
            if path.exists() and get_parameter(config, key) not in (off, str(path))}
        if paths:
            set_parameters(config, {key: str(path) for key, path in paths.items()})
            write_config(config, repo / name)
            changed.append(name)
            log.info("%s: %s", name, ", ".join(f"{k} now {p}" for k, p in paths.items()))
    return changed


def written_root(needs: ServeNeeds) -> PurePosixPath | None:
    """Where the repository was written to be served from (`qvl-trt repo --mount-path`, or
    where it was written): the folder its tensorrtllm models' gpt_model_path names; None
    without such a model (the reference flavor)."""
    roots = set()
    for name in needs.llm_models:
        path = get_parameter(read_config(needs.repo / name), "gpt_model_path") or ""
        engine = PurePosixPath(path)
        if not engine.is_absolute() or engine.parts[-3:] != (name, VERSION, ENGINE_DIR):
            raise ConfigError(f"{name}: gpt_model_path {path!r} is not <repository>/{name}/"
                              f"{VERSION}/{ENGINE_DIR}; regenerate the repository with "
                              "`qvl-trt repo --mount-path PATH`")
        roots.add(engine.parents[2])
    if len(roots) > 1:
        raise ConfigError(f"{needs.repo}: the tensorrtllm models' gpt_model_path name "
                          f"different folders ({', '.join(sorted(map(str, roots)))}); "
                          "regenerate the repository with `qvl-trt repo --mount-path PATH`")
    return next(iter(roots), None)


def resolve_world_size(needs: ServeNeeds, requested: int | None) -> int:
    """The MPI world size to launch: the engines' (every TensorRT-LLM model must share it in
    leader mode), or `requested` when it agrees."""
    wide = {m: w for m, w in needs.engine_world_sizes.items() if w > 1}
    if wide and len(needs.llm_models) > 1:
        # Leader mode gives every rank all tensorrt_llm models and one world; several models
        # with TP > 1 need orchestrator mode (TRTLLM_ORCHESTRATOR=1), which serve does not
        # launch.
        raise ConfigError(
            f"{needs.repo} holds {len(needs.llm_models)} tensorrt_llm models and "
            f"{', '.join(sorted(wide))} use tensor parallelism: one server in leader mode runs "
            "one tensor-parallel engine; write each TP build into its own repository")
    world = needs.world_size
    if requested is not None and requested != world:
        detail = ", ".join(f"{m}: {w}" for m, w in needs.engine_world_sizes.items()) or \
            "no tensorrt_llm model (reference flavor?)"
        raise ConfigError(f"--world-size {requested} does not match the engines' world size "
                          f"({detail}); omit --world-size, serve takes it from the engines")
    return world


def check_vision_editions(needs: ServeNeeds) -> None:
    """Each vision engine's TensorRT edition must import here before a server loads it (the
    stock TensorRT-LLM container has full TensorRT only: GeForce profiles' TensorRT-RTX
    engines need `pip install 'qvl-trt[rtx]'` in it)."""
    from ..vision.engine import trt_module

    for edition in sorted(set(needs.vision_editions.values()), key=lambda e: e.value):
        trt_module(edition)  # DependencyError names the extra to install


def shm_size_bytes(path: Path = SHM_DIR) -> int | None:
    """The size of the shared-memory filesystem, None where there is none."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


def warn_small_shm(needs: ServeNeeds, available: int | None) -> str | None:
    """A warning (also logged) when /dev/shm is smaller than the repository needs."""
    if available is None or available >= needs.shm_bytes:
        return None
    message = (f"/dev/shm has {available / 2**30:.1f} GiB, the repository's largest requests "
               f"need about {needs.shm_bytes / 2**30:.1f} GiB in flight (the python backend "
               "passes tensors through it); in a container pass "
               f"--shm-size={shm_flag(needs.shm_bytes)} or --ipc=host")
    log.warning(message)
    return message


@dataclass(frozen=True)
class ServeCheck:
    check: str
    ok: bool
    detail: str


def serve_checks(needs: ServeNeeds, *, load_models: bool = True) -> tuple[ServeCheck, ...]:
    """`qvl-trt doctor --repo`: the checks `serve` makes before starting, then (with
    `load_models`) whether each python model loads in this Python environment, as rows."""
    rows = []
    try:
        world = resolve_world_size(needs, None)
        rows.append(ServeCheck("world size", True, f"{world} (from the engines)"))
    except QvlError as exc:
        rows.append(ServeCheck("world size", False, str(exc)))
    for model, edition in sorted(needs.vision_editions.items()):
        try:
            check_vision_editions(ServeNeeds(needs.repo, (), {}, 0, 0, {model: edition}))
            rows.append(ServeCheck(f"{model} engine", True, f"{edition.value} imports"))
        except QvlError as exc:
            rows.append(ServeCheck(f"{model} engine", False, str(exc)))
    available = shm_size_bytes()
    warning = warn_small_shm(needs, available)
    have = "unknown" if available is None else f"{available / 2**30:.1f} GiB"
    rows.append(ServeCheck("shared memory", warning is None,
                          warning or f"{have} for about {needs.shm_bytes / 2**30:.1f} GiB"))
    rows.append(ServeCheck("BLS threads", True, f"thread-pool-size {needs.thread_pool_size} for "
                          f"{needs.bls_callers} callers"))
    if load_models:
        rows += model_load_rows(needs.repo)
    return tuple(rows)


def model_load_rows(repo: Path) -> list[ServeCheck]:
    """One row per python model: loaded by a real tritonserver here, or why not."""
    from .load_check import check_model_loads

    try:
        loads = check_model_loads(repo)
    except QvlError as exc:  # no tritonserver, or it did not start
        return [ServeCheck("python models", False, f"not loaded: {exc}")]
    return [ServeCheck(f"{load.model} loads", load.ok, load.detail) for load in loads]
