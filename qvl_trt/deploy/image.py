"""The serving image recipe: a Docker build context FROM the TensorRT-LLM container
(container.py) that adds exactly what qvl-trt's python models and `qvl-trt serve` import and
the container lacks, pinned so that nothing the container already has is upgraded.

The container's package set is data (trtllm_container.toml, with its upstream sources); the
image build checks the real base image against it before and after installing. This module
runs inside that build too (`python3 -m qvl_trt.deploy.image check-base FILE`), so it
imports nothing outside the standard library at module level.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
class ImageRecipe:
    context: Path
    tag: str
    requirements: tuple[str, ...]

    @property
    def build_command(self) -> str:
        return f"docker build -t {shlex.quote(self.tag)} {shlex.quote(str(self.context))}"


def write_image_recipe(dest: Path, *, rtx: bool, tag: str | None = None) -> ImageRecipe:
    """Write the build context `dest`: Dockerfile, requirements.txt, the container's package
    data and a copy of the qvl_trt package with its data folders. Atomic: a failed write
    leaves no `dest`."""
    from ..atomic import staged_dir
    from ..resources import data_dir

    packages = load_container_packages()
    requirements = serving_requirements(rtx=rtx, packages=packages)
    tag = tag or image_tag(rtx=rtx)
    source = Path(__file__).resolve().parents[1]
    with staged_dir(Path(dest)) as ctx:
        home = ctx / "qvl-trt"
        shutil.copytree(source, home / "qvl_trt",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("build_configs", "triton_repo"):
            shutil.copytree(data_dir(name), home / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (ctx / REQUIREMENTS).write_text(
            "# What the serving image adds to the TensorRT-LLM container (qvl-trt image).\n"
            + "".join(f"{r}\n" for r in requirements))
        (ctx / DOCKERFILE).write_text(dockerfile(packages, tag=tag, rtx=rtx))
    return ImageRecipe(Path(dest), tag, requirements)


def dockerfile(packages: ContainerPackages, *, tag: str, rtx: bool) -> str:
    data = f"{IMAGE_HOME}/qvl_trt/deploy/{CONTAINER_PACKAGES.name}"
    recipe = f"{IMAGE_HOME}/image"
    check = f"python3 -m qvl_trt.deploy.image check-base {data}"
    edition = "TensorRT-RTX (GeForce profiles)" if rtx else "full TensorRT"
    return f"""\
# The qvl-trt serving image: {packages.image} plus what qvl-trt's python models and
# `qvl-trt serve` import that it lacks; vision engines on {edition}.
# Written by `qvl-trt image`; build it with: docker build -t {tag} .
FROM {packages.image}
COPY qvl-trt {IMAGE_HOME}
COPY {REQUIREMENTS} {recipe}/{REQUIREMENTS}
ENV PYTHONPATH={IMAGE_HOME}${{PYTHONPATH:+:${{PYTHONPATH}}}}
# The base must carry the packages the recipe relies on, at versions qvl-trt works with
# (a version other than upstream's pin only warns).
RUN {check}
# Pin every package the base already has, so the additions upgrade none of them (TensorRT-LLM
# and the stock backend were built against those); the image's Python is system-managed.
RUN python3 -m pip list --format=freeze > {recipe}/constraints.txt \\
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \\
        -c {recipe}/constraints.txt -r {recipe}/{REQUIREMENTS} \\
 && {check}
RUN printf '#!/usr/bin/env python3\\nfrom qvl_trt.cli import main\\nmain()\\n' \\
        > /usr/local/bin/qvl-trt && chmod +x /usr/local/bin/qvl-trt \\
 && qvl-trt --version
# Not root: the base's own user (Pod Security "restricted" refuses root; the pod names the
# same ids). It only reads what was installed above.
RUN [ "$(id -u {SERVE_USER})" = {SERVE_UID} ] && [ "$(id -g {SERVE_USER})" = {SERVE_GID} ]
USER {SERVE_UID}:{SERVE_GID}
"""


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
         "       python3 -m qvl_trt.deploy.image write DIR [--rtx]")


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
    if len(argv) in (2, 3) and argv[0] == "write" and argv[2:] in ([], ["--rtx"]):
        recipe = write_image_recipe(Path(argv[1]), rtx=argv[2:] == ["--rtx"])
        print(recipe.tag)
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
