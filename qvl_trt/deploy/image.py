"""The serving image recipe: a Docker build context FROM the TensorRT-LLM container
(container.py) that adds exactly what qvl-trt's python models and `qvl-trt serve` import and
the container lacks, pinned so that nothing the container already has is upgraded; baked
(`bake_repo`), it also carries a repository and serves it when run with no arguments.

Layers, from the least often changed: the base check and the additions (requirements.txt);
then, baked, each engine folder in a layer of its own, the rest of the repository (configs,
tokenizer: small); then qvl-trt's source. A new qvl-trt or a changed config rebuilds and
pushes only the layers after the engines; the engines' layers stay in the build cache and
the registry for as long as the additions and the engines themselves do not change.

The container's package set is data (trtllm_container.toml, with its upstream sources); the
image build checks the real base image against it before and after installing. This module
runs inside that build too, as a script copied alone (`python3 image.py check-base FILE`),
so it imports nothing outside the standard library at module level.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from ..serve.needs import ServeNeeds

CONTAINER_PACKAGES = Path(__file__).with_name("trtllm_container.toml")
# Inside the image: the qvl_trt package and its data folders (on PYTHONPATH), and the recipe.
IMAGE_HOME = "/opt/qvl-trt"
# The extras a serving image needs beside the core dependencies: the gateway of
# `serve --openai-port`, video decoding in preprocessing; `rtx` for GeForce profiles, whose
# vision engines run on TensorRT-RTX, which the container lacks.
SERVING_EXTRAS = ("gateway", "video")
RTX_EXTRA = "rtx"
# The user the image's processes run as: the base image's own non-root user, which Triton's
# build.py creates with these ids (triton-inference-server/server build.py,
# create_dockerfile_linux: "useradd $TRITON_SERVER_USER" checked to be 1000:1000).
SERVE_USER, SERVE_UID, SERVE_GID = "triton-server", 1000, 1000
DOCKERFILE = "Dockerfile"
REQUIREMENTS = "requirements.txt"
# In a baked recipe's build context: the engine folders (ENGINES/<model>/<version>/<engine>)
# apart from the rest of the repository (REPOSITORY), so that each is a COPY, and a layer,
# of its own.
ENGINES = "engines"
REPOSITORY = "repository"
# Where a baked repository without a tensorrtllm model (which fixes its own path) goes.
BAKED_REPO = f"{IMAGE_HOME}/repository"
# serve's --health-port (GET /ready, /live) in a container and a pod: the port after Triton's
# three; the OpenAI gateway on its own default port.
HEALTH_PORT = 8003


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class ContainerPackage:
    name: str
    spec: str  # what upstream pins ("" = unpinned, but present); outside it: a warning
    needs: str  # what qvl-trt's code works with ("" = any); outside it: an error
    here: str | None  # version of the check environment; None = not installable there


@dataclass(frozen=True)
class ContainerPackages:
    image: str
    python: str
    packages: tuple[ContainerPackage, ...]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(canonical(p.name) for p in self.packages)

    @property
    def not_here(self) -> tuple[str, ...]:
        """Packages the container has that a check environment cannot install."""
        return tuple(p.name for p in self.packages if p.here is None)


def load_container_packages(path: Path = CONTAINER_PACKAGES) -> ContainerPackages:
    data = tomllib.loads(Path(path).read_text())
    packages = tuple(
        ContainerPackage(name, entry.get("spec", ""), entry.get("needs", ""),
                         None if entry.get("here", "none") == "none" else entry["here"])
        for name, entry in data["packages"].items())
    return ContainerPackages(data["image"], data["python"], packages)


def check_environment_requirements(packages: ContainerPackages) -> list[str]:
    """pip requirements that reproduce the container's packages where they install without
    the container (`here` versions)."""
    return [f"{p.name}=={p.here}" for p in packages.packages if p.here is not None]


def serving_requirements(*, rtx: bool, packages: ContainerPackages | None = None
                         ) -> tuple[str, ...]:
    """What the image adds: qvl-trt's core dependencies and SERVING_EXTRAS (and RTX_EXTRA)
    that the container does not have. Those it has stay at its versions (the constraints),
    and the container-equivalent check proves our code works with them."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement

    packages = packages or load_container_packages()
    extras = {*SERVING_EXTRAS, *((RTX_EXTRA,) if rtx else ())}
    python = {"python_version": packages.python, "python_full_version": f"{packages.python}.0"}
    wanted = []
    for line in _declared_requirements():
        req = Requirement(line)
        marker = req.marker
        core = marker is None or marker.evaluate({**python, "extra": ""})
        if not core and not any(marker.evaluate({**python, "extra": e}) for e in extras):
            continue
        if canonical(req.name) == "qvl-trt":  # an extra naming other extras of ours
            continue
        if canonical(req.name) in packages.names:
            continue
        req.marker = None
        wanted.append(str(req))
    return tuple(sorted(dict.fromkeys(wanted), key=str.lower))


def _declared_requirements() -> list[str]:
    """qvl-trt's requirements as PEP 508 lines with `extra == ...` markers: from pyproject.toml
    in a source checkout, else from the installed distribution's metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text())["project"]
        lines = list(project["dependencies"])
        for extra, reqs in project.get("optional-dependencies", {}).items():
            for req in reqs:
                spec, _, marker = req.partition(";")
                own = f" and ({marker.strip()})" if marker.strip() else ""
                lines.append(f"{spec.strip()}; extra == '{extra}'{own}")
        return lines
    from importlib.metadata import requires

    return list(requires("qvl-trt") or [])


def image_tag(*, rtx: bool) -> str:
    """The default tag of a serving image: qvl-trt's version and the TensorRT edition of
    its vision engines."""
    from .. import __version__

    return f"qvl-trt:{__version__}-{'rtx' if rtx else 'trt'}"


@dataclass(frozen=True)
class BakedRepo:
    """A repository the image carries."""
    root: str  # where the image holds it
    engines: tuple[str, ...]  # the models whose engine folders are layers of their own
    startup_s: float  # its startup window (serve/load_time.py), the health check's grace


@dataclass(frozen=True)
class ImageRecipe:
    context: Path
    tag: str
    requirements: tuple[str, ...]
    baked_root: str | None = None  # where a baked repository is in the image; None: none
    repo_bytes: int = 0  # the baked repository's files (its engines, tokenizer, configs)
    needs: ServeNeeds | None = None  # what serving the repository takes; None: none given

    @property
    def build_command(self) -> str:
        return f"docker build -t {shlex.quote(self.tag)} {shlex.quote(str(self.context))}"


def write_image_recipe(dest: Path, *, rtx: bool, tag: str | None = None,
                       bake_repo: Path | None = None) -> ImageRecipe:
    """Write the build context `dest`: Dockerfile, requirements.txt, the container's package
    data and a copy of the qvl_trt package with its data folders; with `bake_repo`, that
    repository too (ENGINES, REPOSITORY), which the image serves by default. Atomic: a
    failed write leaves no `dest`."""
    from ..atomic import staged_dir
    from ..resources import data_dir

    packages = load_container_packages()
    requirements = serving_requirements(rtx=rtx, packages=packages)
    tag = tag or image_tag(rtx=rtx)
    source = Path(__file__).resolve().parents[1]
    baked: BakedRepo | None = None
    repo_bytes = 0
    with staged_dir(Path(dest)) as ctx:
        home = ctx / "qvl-trt"
        shutil.copytree(source, home / "qvl_trt",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("build_configs", "triton_repo"):
            shutil.copytree(data_dir(name), home / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        if bake_repo is not None:
            baked = _baked(Path(bake_repo), ctx)
            repo_bytes = sum(f.stat().st_size for f in ctx.rglob("*") if f.is_file()
                             and f.parts[len(ctx.parts)] in (ENGINES, REPOSITORY))
        (ctx / REQUIREMENTS).write_text(
            "# What the serving image adds to the TensorRT-LLM container (qvl-trt image).\n"
            + "".join(f"{r}\n" for r in requirements))
        (ctx / DOCKERFILE).write_text(dockerfile(packages, tag=tag, rtx=rtx, baked=baked))
    return ImageRecipe(Path(dest), tag, requirements, baked.root if baked else None,
                       repo_bytes)


def write_serving_recipe(out: Path, *, repo: Path | None = None, rtx: bool | None = None,
                         tag: str | None = None, bake_repo: bool = False,
                         force: bool = False) -> ImageRecipe:
    """`qvl-trt image`: the recipe of an image that serves `repo` (None: no repository in
    mind), written to `out`, replacing it only with `force`; `rtx` None: whether `repo` has a
    vision engine on TensorRT-RTX; `bake_repo`: the image carries `repo`. The recipe's
    `needs` are `repo`'s, for the `docker run` line that serves it."""
    from ..errors import ConfigError

    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to replace it")
    if bake_repo and repo is None:
        raise ConfigError("--bake-repo copies --repo into the image; pass --repo REPOSITORY")
    needs = None
    if repo is not None:
        from ..profiles import TrtEdition
        from ..serve.needs import read_needs

        if not repo.is_dir():
            raise ConfigError(f"{repo} is not a folder; pass a model repository written by "
                              "`qvl-trt repo`")
        needs = read_needs(repo)
        if rtx is None:
            rtx = TrtEdition.TENSORRT_RTX in needs.vision_editions.values()
    recipe = write_image_recipe(out, rtx=bool(rtx), tag=tag,
                                bake_repo=repo if bake_repo else None)
    return replace(recipe, needs=needs)


def _baked(repo: Path, ctx: Path) -> BakedRepo:
    """`repo` copied into the build context. The image holds it where its tensorrtllm models'
    gpt_model_path names (the backend takes absolute paths, and serve cannot re-point them
    in a read-only image), else at BAKED_REPO."""
    from ..errors import ConfigError
    from ..serve.load_time import read_load_time, startup_window_s
    from ..serve.needs import read_needs, written_root

    if not repo.is_dir():
        raise ConfigError(f"--repo {repo} is not a folder; pass a model repository written by "
                          "`qvl-trt repo` or `qvl-trt build`")
    root = str(written_root(read_needs(repo)) or BAKED_REPO)
    return BakedRepo(root, _copy_repository(repo, ctx), startup_window_s(read_load_time(repo)))


def _copy_repository(repo: Path, ctx: Path) -> tuple[str, ...]:
    """Copy `repo` into the build context, its engine folders under ENGINES and the rest under
    REPOSITORY, as hard links where the file system allows (engines are GBs). Every file ends
    up readable, and every folder listable, by anyone: the image's files are root's, and its
    user (SERVE_UID) only reads them. Returns the models whose engine folders are apart."""
    from ..triton.layout import ENGINE_DIR, VERSION

    def readable(src: str, dst: str) -> None:
        if os.stat(src).st_mode & 0o004:
            try:
                os.link(src, dst)
                return
            except OSError:  # another file system
                pass
        shutil.copy2(src, dst)
        os.chmod(dst, os.stat(dst).st_mode | 0o444)  # a copy: the repository stays as it is

    engines = tuple(sorted(p.parent.parent.name for p in repo.glob(f"*/{VERSION}/{ENGINE_DIR}")
                           if p.is_dir()))
    for model in engines:
        folder = f"{model}/{VERSION}/{ENGINE_DIR}"
        shutil.copytree(repo / folder, ctx / ENGINES / folder, copy_function=readable)
    inner = {str(repo / model / VERSION) for model in engines}
    shutil.copytree(repo, ctx / REPOSITORY, copy_function=readable, ignore=lambda folder, names:
                    [ENGINE_DIR] if folder in inner else [])
    for top in (ctx / ENGINES, ctx / REPOSITORY):
        for folder in (top, *(p for p in top.rglob("*") if p.is_dir())):
            folder.chmod(0o755)
    return engines


def serve_arguments(repo: str, *, host: str, inference_host: str, openai_port: int,
                    health_port: int = HEALTH_PORT, drain_timeout_s: float | None = None
                    ) -> list[str]:
    """`qvl-trt serve` of `repo` in a container or a pod: every address (`host`) for the
    gateway, the metrics and the health endpoint; Triton's HTTP and gRPC, which ask no key, on
    `inference_host`; Triton's default ports."""
    from ..serve.server import Ports

    ports = Ports()
    args = ["qvl-trt", "serve", repo, "--host", host, "--inference-host", inference_host,
            "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
            "--metrics-port", str(ports.metrics),
            "--health-port", str(health_port), "--openai-port", str(openai_port)]
    if drain_timeout_s is not None:
        args += ["--drain-timeout", f"{drain_timeout_s:g}"]
    return args


def baked_serve_arguments(root: str) -> list[str]:
    """What a baked image runs by default: the repository on the default ports, the gateway
    (QVL_TRT_API_KEY in the environment: its key) on every address, Triton's own endpoints on
    the loopback interface."""
    from ..gateway.options import DEFAULT_PORT

    return serve_arguments(root, host="0.0.0.0", inference_host="127.0.0.1",
                           openai_port=DEFAULT_PORT)


def dockerfile(packages: ContainerPackages, *, tag: str, rtx: bool,
               baked: BakedRepo | None = None) -> str:
    recipe = f"{IMAGE_HOME}/image"
    check = f"python3 {recipe}/{Path(__file__).name} check-base {recipe}/{CONTAINER_PACKAGES.name}"
    edition = "TensorRT-RTX (GeForce profiles)" if rtx else "full TensorRT"
    data = "qvl-trt/qvl_trt/deploy"
    text = f"""\
# The qvl-trt serving image: {packages.image} plus what qvl-trt's python models and
# `qvl-trt serve` import that it lacks; vision engines on {edition}.
# Written by `qvl-trt image`; build it with: docker build -t {tag} .
FROM {packages.image}
# The base check alone (this module runs as a script, standard library only), so that the
# layers up to the engines do not change with qvl-trt's source.
COPY {REQUIREMENTS} {data}/{Path(__file__).name} {data}/{CONTAINER_PACKAGES.name} {recipe}/
# The base must carry the packages the recipe relies on, at versions qvl-trt works with
# (a version other than upstream's pin only warns).
RUN {check}
# Pin every package the base already has, so the additions upgrade none of them (TensorRT-LLM
# and the stock backend were built against those); the image's Python is system-managed.
RUN python3 -m pip list --format=freeze > {recipe}/constraints.txt \\
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \\
        -c {recipe}/constraints.txt -r {recipe}/{REQUIREMENTS} \\
 && {check}
"""
    if baked is not None:
        text += f"""\
# The repository, served from {baked.root}: each engine folder in a layer of its own, before
# what changes more often. Root's files, readable by all: the image's user reads them and
# cannot change them.
"""
        text += "".join(f"COPY {ENGINES}/{model} {baked.root}/{model}\n"
                        for model in baked.engines)
        text += f"COPY {REPOSITORY} {baked.root}\n"
    text += f"""\
COPY qvl-trt {IMAGE_HOME}
ENV PYTHONPATH={IMAGE_HOME}${{PYTHONPATH:+:${{PYTHONPATH}}}}
RUN printf '#!/usr/bin/env python3\\nfrom qvl_trt.cli import main\\nmain()\\n' \\
        > /usr/local/bin/qvl-trt && chmod +x /usr/local/bin/qvl-trt \\
 && qvl-trt --version
# Not root: the base's own user (Pod Security "restricted" refuses root; the pod names the
# same ids). It only reads what was installed above.
RUN [ "$(id -u {SERVE_USER})" = {SERVE_UID} ] && [ "$(id -g {SERVE_USER})" = {SERVE_GID} ]
USER {SERVE_UID}:{SERVE_GID}
"""
    if baked is not None:
        ready = f"http://127.0.0.1:{HEALTH_PORT}/ready"
        probe = ["python3", "-c", f"import urllib.request; urllib.request.urlopen({ready!r}, "
                 "timeout=5)"]
        text += f"""\
# `docker run --gpus all IMAGE` serves the repository. CMD, not ENTRYPOINT: the base's
# entrypoint (/opt/nvidia/nvidia_entrypoint.sh) sets the container's environment up and then
# execs it (triton-inference-server/server docker/cpu_only/nvidia_entrypoint.sh), and other
# arguments to `docker run` (a pod's args) replace it.
CMD {json.dumps(baked_serve_arguments(baked.root))}
# Healthy while serve's /ready answers 200 (a 503 raises), after the repository's startup
# window (serve/load_time.py); Kubernetes ignores it and asks the same endpoint itself.
HEALTHCHECK --interval=10s --timeout=10s --start-period={baked.startup_s:.0f}s \\
    CMD {json.dumps(probe)}
"""
    return text


@dataclass(frozen=True)
class BaseCheck:
    """What `check_base` found: errors stop the image build, warnings do not."""
    errors: tuple[str, ...]
    warnings: tuple[str, ...]


def check_base(path: Path, site: Path | None = None) -> BaseCheck:
    """Inside the image build: the installed packages (those of the folder `site`, else this
    interpreter's) against the data file, one line each. A package missing or outside what
    qvl-trt needs is an error; outside upstream's pin only, a warning."""
    from importlib.metadata import distributions

    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.specifiers import SpecifierSet

    found = distributions(path=[str(site)]) if site is not None else distributions()
    installed: dict[str, str] = {}
    for dist in found:
        # The first on the path is the one imported, as importlib.metadata.version picks.
        installed.setdefault(canonical(dist.metadata["Name"] or ""), dist.version)

    def inside(have: str, spec: str) -> bool:
        return SpecifierSet(spec, prereleases=True).contains(have, prereleases=True)

    errors, warnings = [], []
    for package in load_container_packages(path).packages:
        have = installed.get(canonical(package.name))
        if have is None:
            errors.append(f"{package.name} is not installed in the base image")
        elif package.needs and not inside(have, package.needs):
            errors.append(f"{package.name} {have} is outside {package.needs}, "
                          "which qvl-trt needs")
        elif package.spec and not inside(have, package.spec):
            warnings.append(f"{package.name} {have} is outside {package.spec}, upstream's "
                            "pin for this base; qvl-trt works with it")
    return BaseCheck(tuple(errors), tuple(warnings))


USAGE = ("usage: python3 -m qvl_trt.deploy.image check-base PACKAGES.toml [--site DIR]\n"
         "       python3 -m qvl_trt.deploy.image write DIR [--rtx] [--bake-repo REPO]")


def _main(argv: list[str]) -> int:
    """The two steps that run without qvl-trt's CLI dependencies: the image build's base
    check, and writing a recipe from a source checkout (scripts/verify_gpu.sh)."""
    if argv[:1] == ["check-base"] and (len(argv) == 2 or (len(argv) == 4
                                                          and argv[2] == "--site")):
        found = check_base(Path(argv[1]), Path(argv[3]) if len(argv) == 4 else None)
        for line in found.warnings:
            print(f"warning: {line}", file=sys.stderr)
        for line in found.errors:
            print(f"error: {line}; this recipe was written for another base image: "
                  "regenerate it with `qvl-trt image` of a matching qvl-trt", file=sys.stderr)
        return 1 if found.errors else 0
    if argv[:1] == ["write"] and len(argv) >= 2:
        rtx = "--rtx" in argv[2:]
        rest = [a for a in argv[2:] if a != "--rtx"]
        if len(rest) in (0, 2) and rest[:1] in ([], ["--bake-repo"]):
            recipe = write_image_recipe(Path(argv[1]), rtx=rtx,
                                        bake_repo=Path(rest[1]) if rest else None)
            print(recipe.tag)
            return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
