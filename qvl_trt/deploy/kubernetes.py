"""Kubernetes manifests for a generated model repository (`qvl-trt deploy`).

One folder for `kubectl apply -f`: a Deployment whose pods run `qvl-trt serve` (tritonserver
under its supervisor, the OpenAI gateway and the readiness endpoint) from the serving image on
nodes with the repository's GPU; a Service in front of the gateway and Triton's ports; a
PodDisruptionBudget; optionally a HorizontalPodAutoscaler on the LLM's queue. What a pod needs
is read from the repository (`read_serve_plan`). Each pod is a whole server on one node (a
tensor-parallel engine's ranks share it); scaling past one node is replicas behind the
Service.

The repository is mounted read-only at the path it was written for (`qvl-trt repo
--mount-path`, or where it was written): the tensorrtllm backend reads gpt_model_path as an
absolute path, and `serve` re-points a moved repository by rewriting its config.pbtxt
(point_engine_paths), which a read-only volume refuses and which several replicas sharing a
volume would race on. Another --mount-path is refused with the command that rewrites the
repository for it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from ..atomic import staged_dir
from ..deps import require
from ..errors import ConfigError
from ..gateway.options import API_KEY_ENV, DEFAULT_PORT, GatewayOptions
from ..gateway.readiness import LIVE_PATH, READY_PATH
from ..profiles import check_gpu_product, gpu_product_label
from ..serve.gateway_process import STOP_GRACE_S
from ..serve.liveness import LivenessRules
from ..serve.needs import (
    ServePlan,
    read_serve_plan,
    resolve_world_size,
    shm_gib,
    written_root,
)
from ..serve.server import SHM_DIR, STARTUP_TIMEOUT_S, UNLOAD_GRACE_S, Ports, ServerOptions
from ..serve.supervisor import START_ATTEMPTS

MIB, GIB = 2**20, 2**30
DEFAULT_NAME = "qvl-trt"
# serve's --health-port (GET /ready, /live) in the pod: the port after Triton's three.
HEALTH_PORT = 8003
API_KEY_SECRET_KEY = "api-key"  # the key of the optional Secret that holds the API key
# The device plugin's resource and GPU feature discovery's product label
# (NVIDIA/k8s-device-plugin internal/lm/resource.go: fullGPUResourceName, "product").
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# The requests waiting for a batch slot of the pod's LLM, per caller instance (summed per
# pod by the metrics adapter; triton/runtime/postprocessing.py QueueMetrics). Not Triton's
# nv_inference_pending_request_count: it counts a request from PENDING until a model instance
# executes it (core infer_request.cc), and the decoupled models here and the stock
# tensorrtllm backend take every request at once and queue it themselves, so it stays at 0.
QUEUE_METRIC = "qvl_llm_requests_waiting"

# Host memory per process, requested and limited alike (see pod_needs). A python model
# instance without CUDA: the stubs of a tiny repository held 70 MiB (postprocessing) to
# 250 MiB (preprocessing: numpy, numba, the tokenizer) resident on a CPU; twice the larger
# leaves room for a request's own arrays.
STUB_BYTES = 512 * MIB
# A process with a CUDA context and TensorRT or TensorRT-LLM loaded (each tritonserver rank,
# each vision_encoder instance): an allowance, not measured here (no GPU); a CUDA context
# alone takes a few hundred MiB of host memory, the libraries' pages more once touched.
CUDA_PROCESS_BYTES = 2 * GIB

# The startup probe must not kill a pod that serve is still starting: serve tries
# START_ATTEMPTS starts of up to STARTUP_TIMEOUT_S each (the engines load meanwhile), then
# /ready turns 200 once the first end-to-end probe answers (an idle server answers it at
# once; one that does not within the stall timeout is restarted, serve/liveness.py). When
# serve gives up it exits and the kubelet restarts the pod.
STARTUP_PERIOD_S = 10
STARTUP_WINDOW_S = START_ATTEMPTS * (STARTUP_TIMEOUT_S + LivenessRules.stall_timeout_s)
# Endpoints and proxies drop a terminating pod asynchronously: it keeps serving this long
# after it is told to stop, before SIGTERM.
PRESTOP_S = 5
# On SIGTERM serve drains the gateway first (its shutdown timeout, then STOP_GRACE_S until
# it is killed), then tritonserver (its drain budget, then UNLOAD_GRACE_S); the kubelet's
# grace period counts from the preStop hook and must cover all of it.
DRAIN_MARGIN_S = 10
GRACE_S = math.ceil(PRESTOP_S + GatewayOptions.shutdown_timeout_s + STOP_GRACE_S
                    + ServerOptions.drain_timeout_s + UNLOAD_GRACE_S + DRAIN_MARGIN_S)

# Kubernetes names (k8s.io/apimachinery pkg/util/validation/validation.go): a Service name is
# a DNS-1035 label, a namespace a DNS-1123 label, a claim or Secret a DNS-1123 subdomain.
_DNS1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class DeployOptions:
    image: str  # the serving image, with `qvl-trt` and `tritonserver` on PATH
    name: str = DEFAULT_NAME
    namespace: str | None = None  # None: kubectl's current namespace
    replicas: int = 1  # with the autoscaler: its minimum
    openai_port: int = DEFAULT_PORT
    health_port: int = HEALTH_PORT
    mount_path: str | None = None  # None: the path the repository was written for
    claim: str | None = None  # PersistentVolumeClaim holding the repository [NAME-repository]
    claim_path: str = ""  # the repository's folder inside the claim ("" = its root)
    host_path: str | None = None  # instead of a claim: the repository's folder on each node
    gpu_product: str | None = None  # None: the profile's gpu.product
    cpu: float | None = None  # None: derived (pod_needs)
    memory_gib: float | None = None  # None: derived (pod_needs)
    hpa: bool = False
    max_replicas: int = 4
    target_pending: float = 2.0  # the autoscaler's average queued requests per pod
    api_key_secret: str | None = None  # Secret holding the gateway's key [NAME-api-key]

    def __post_init__(self) -> None:
        if not self.image or any(ch.isspace() for ch in self.image):
            raise ConfigError(f"--image {self.image!r} is empty or has blanks; give the serving "
                              "image's reference, e.g. registry.example.com/qvl-trt-serve:4090d")
        _name(self.name, _DNS1035, "--name", "a lowercase DNS label starting with a letter "
              "(letters, digits, '-'; at most 63)")
        if self.namespace is not None:
            _name(self.namespace, _DNS1123_LABEL, "--namespace",
                  "a lowercase DNS label (letters, digits, '-'; at most 63)")
        for option, value in (("--claim", self.claim), ("--api-key-secret", self.api_key_secret)):
            if value is not None:
                _name(value, _DNS1123_SUBDOMAIN, option,
                      "a lowercase DNS name (letters, digits, '-', '.')")
        if self.replicas < 1:
            raise ConfigError(f"--replicas {self.replicas} must be at least 1")
        if self.hpa and self.max_replicas < self.replicas:
            raise ConfigError(f"--max-replicas {self.max_replicas} is below --replicas "
                              f"{self.replicas} (the autoscaler's minimum); raise it")
        if self.target_pending <= 0:
            raise ConfigError(f"--target-pending {self.target_pending} must be positive")
        ports = {"--openai-port": self.openai_port, "--health-port": self.health_port}
        for option, port in ports.items():
            if not 0 < port < 65536:
                raise ConfigError(f"{option} {port} is not a TCP port; use 1-65535")
        taken = {*ports.values(), *_triton_ports().values()}
        if len(taken) < len(ports) + len(_triton_ports()):
            raise ConfigError(f"--openai-port {self.openai_port} and --health-port "
                              f"{self.health_port} must differ from each other and from "
                              f"Triton's ports {sorted(_triton_ports().values())}")
        if self.mount_path is not None and not PurePosixPath(self.mount_path).is_absolute():
            raise ConfigError(f"--mount-path {self.mount_path!r} must be an absolute path")
        if self.host_path is not None:
            if self.claim is not None:
                raise ConfigError("give the repository's volume as --claim or --host-path, "
                                  "not both")
            if not PurePosixPath(self.host_path).is_absolute():
                raise ConfigError(f"--host-path {self.host_path!r} must be an absolute path")
        if self.claim_path and self.host_path is not None:
            raise ConfigError("--claim-path names a folder inside --claim; with --host-path, "
                              "give the repository's folder itself")
        inside = PurePosixPath(self.claim_path)
        if inside.is_absolute() or ".." in inside.parts:
            raise ConfigError(f"--claim-path {self.claim_path!r} must be a relative path "
                              "inside the claim, without '..'")
        if self.gpu_product is not None:
            check_gpu_product(gpu_product_label(self.gpu_product), "--gpu-product")
        for option, value in (("--cpu", self.cpu), ("--memory-gib", self.memory_gib)):
            if value is not None and value <= 0:
                raise ConfigError(f"{option} {value} must be positive")

    @property
    def claim_name(self) -> str:
        return self.claim or f"{self.name}-repository"

    @property
    def secret_name(self) -> str:
        return self.api_key_secret or f"{self.name}-api-key"


def _name(value: str, pattern: re.Pattern, option: str, rule: str) -> None:
    if not pattern.fullmatch(value):
        raise ConfigError(f"{option} {value!r} is not a Kubernetes name: use {rule}")


def _triton_ports() -> dict[str, int]:
    ports = Ports()
    return {"http": ports.http, "grpc": ports.grpc, "metrics": ports.metrics}


@dataclass(frozen=True)
class PodNeeds:
    """What one pod takes, with the reasoning the manifest's header states."""

    gpus: int
    gpu_product: str
    mount_path: PurePosixPath
    shm_bytes: int  # the memory-backed /dev/shm
    cpu: float
    memory_bytes: int
    notes: tuple[str, ...]  # one line per derived figure


def pod_needs(plan: ServePlan, opts: DeployOptions) -> PodNeeds:
    """GPUs, node label, mount path, /dev/shm, CPU and memory of one pod serving `plan`.

    Requests equal limits (the Guaranteed QoS class: the last a node evicts under memory
    pressure). CPU: one core per process that works at once: each python model instance (a
    stub process running one request at a time), each tritonserver rank and the gateway.
    Memory: the memory-backed /dev/shm (its files count against the pod's memory limit;
    Kubernetes' EmptyDirVolumeSource.sizeLimit), the engines' bytes (each is read into host
    memory to be deserialized) and an allowance per process (STUB_BYTES,
    CUDA_PROCESS_BYTES), rounded up to GiB.
    """
    repo = plan.repo
    if not plan.llm_models:
        raise ConfigError(f"{repo} holds no tensorrt_llm model (a reference-flavor "
                          "repository, or not a repository); `qvl-trt deploy` writes "
                          "manifests for the trt flavor: `qvl-trt repo --flavor trt`")
    gpus = resolve_world_size(plan, None)
    product = _gpu_product(plan, opts)
    written = written_root(plan)
    if opts.mount_path is not None and PurePosixPath(opts.mount_path) != written:
        raise ConfigError(
            f"--mount-path {opts.mount_path}: {repo} was written to be served from {written} "
            "(its engines' gpt_model_path), and the volume is mounted read-only; omit "
            "--mount-path, or rewrite the repository with `qvl-trt repo --build ... "
            f"--mount-path {opts.mount_path}`")
    shm = shm_gib(plan.shm_bytes) * GIB
    stubs = sum(plan.instances.values())
    vision = sum(plan.instances.get(m, 0) for m in plan.vision_editions)
    cuda = gpus + vision  # tritonserver ranks and vision_encoder instances
    plain = stubs - vision + 1  # the other python model instances and the gateway
    notes = [f"GPUs: {gpus}, the LLM engine's world size (one tritonserver rank per GPU), "
             f"on nodes labelled {GPU_PRODUCT_LABEL}={product}"]
    if opts.cpu is None:
        cpu = float(stubs + gpus + 1)
        notes.append(f"CPU: {cpu:g}, one per python model instance ({stubs}), tritonserver "
                     f"rank ({gpus}) and the gateway (1)")
    else:
        cpu = opts.cpu
        notes.append(f"CPU: {cpu:g} (--cpu)")
    if opts.memory_gib is None:
        need = shm + plan.engine_bytes + plain * STUB_BYTES + cuda * CUDA_PROCESS_BYTES
        memory = -(-need // GIB) * GIB
        notes.append(
            f"memory: {memory // GIB} GiB, /dev/shm {shm // GIB} GiB + engines "
            f"{plan.engine_bytes / GIB:.1f} GiB + {STUB_BYTES // MIB} MiB x {plain} processes "
            f"without CUDA + {CUDA_PROCESS_BYTES // GIB} GiB x {cuda} with CUDA, rounded up")
    else:
        memory = math.ceil(opts.memory_gib * GIB / MIB) * MIB
        if memory < shm + plan.engine_bytes:
            raise ConfigError(f"--memory-gib {opts.memory_gib:g} is below /dev/shm and the "
                              f"engines ({(shm + plan.engine_bytes) / GIB:.1f} GiB), which "
                              "count against the pod's memory; raise it")
        notes.append(f"memory: {opts.memory_gib:g} GiB (--memory-gib)")
    notes.append(f"/dev/shm: {shm // GIB} GiB in memory, for the python backend's tensors of "
                 "the largest requests in flight")
    notes.append(f"startup: up to {STARTUP_WINDOW_S:.0f} s, serve's {START_ATTEMPTS} starts of "
                 f"{STARTUP_TIMEOUT_S:.0f} s, each with its first probe (the stall timeout, "
                 f"{LivenessRules.stall_timeout_s:.0f} s)")
    notes.append(f"termination: {GRACE_S} s, the preStop pause, the gateway's and "
                 "tritonserver's drains and a margin")
    return PodNeeds(gpus, product, written, shm, cpu, memory, tuple(notes))


def _gpu_product(plan: ServePlan, opts: DeployOptions) -> str:
    if opts.gpu_product is not None:
        return gpu_product_label(opts.gpu_product)
    products = {b.profile.name: b.profile.gpu.product for b in plan.builds}
    named = set(products.values()) - {""}
    if len(named) > 1:
        listed = ", ".join(f"{n}: {p}" for n, p in sorted(products.items()))
        raise ConfigError(f"{plan.repo} holds builds for different GPUs ({listed}) and one pod "
                          "runs them all on one; pass --gpu-product LABEL")
    if not named or "" in products.values():
        names = ", ".join(sorted(products)) or "none recorded"
        raise ConfigError(f"the repository's GPU profile ({names}) names no gpu.product, the "
                          f"{GPU_PRODUCT_LABEL} node label; pass --gpu-product LABEL "
                          f"(`kubectl get nodes -L {GPU_PRODUCT_LABEL}` lists your nodes')")
    return named.pop()


def manifests(opts: DeployOptions, needs: PodNeeds) -> dict[str, dict[str, Any]]:
    """File name -> Kubernetes object, for pods that need `needs` (pod_needs)."""
    labels = {"app.kubernetes.io/name": "qvl-trt", "app.kubernetes.io/instance": opts.name}
    meta: dict[str, Any] = {"name": opts.name, "labels": labels}
    if opts.namespace is not None:
        meta["namespace"] = opts.namespace
    docs = {
        "deployment.yaml": _deployment(opts, needs, meta, labels),
        "service.yaml": {
            "apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"selector": labels, "ports": [
                {"name": name, "port": port, "targetPort": name}
                for name, port in _service_ports(opts).items()]}},
        # maxUnavailable, not minAvailable: a single replica must not block node drains.
        "pdb.yaml": {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}}},
    }
    if opts.hpa:
        docs["hpa.yaml"] = _autoscaler(opts, meta)
    return docs


def _service_ports(opts: DeployOptions) -> dict[str, int]:
    return {"openai": opts.openai_port, **_triton_ports()}


def _deployment(opts: DeployOptions, needs: PodNeeds, meta: dict[str, Any],
                labels: dict[str, str]) -> dict[str, Any]:
    ports = Ports()
    mount = str(needs.mount_path)
    serve = ["qvl-trt", "serve", mount, "--host", "0.0.0.0",
             "--http-port", str(ports.http), "--grpc-port", str(ports.grpc),
             "--metrics-port", str(ports.metrics),
             "--health-port", str(opts.health_port), "--openai-port", str(opts.openai_port)]
    resources = {"cpu": _cpu_quantity(needs.cpu), "memory": _bytes_quantity(needs.memory_bytes),
                 GPU_RESOURCE: needs.gpus}
    repo_mount: dict[str, Any] = {"name": "repository", "mountPath": mount, "readOnly": True}
    if opts.host_path is None:
        volume: dict[str, Any] = {"persistentVolumeClaim": {"claimName": opts.claim_name,
                                                            "readOnly": True}}
        if opts.claim_path:
            repo_mount["subPath"] = str(PurePosixPath(opts.claim_path))
    else:
        volume = {"hostPath": {"path": opts.host_path, "type": "Directory"}}

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "health"}, "periodSeconds": period,
                "timeoutSeconds": 5, "failureThreshold": failures}

    container = {
        "name": "serve",
        "image": opts.image,
        # args, not command: the image's entrypoint stays in front. The NGC containers' is
        # /opt/nvidia/nvidia_entrypoint.sh, which sources entrypoint.d/ (their environment
        # setup) and then execs its arguments, so serve still gets the kubelet's SIGTERM
        # (triton-inference-server/server docker/cpu_only/nvidia_entrypoint.sh).
        "args": serve,
        # The gateway's key from an optional Secret: never on a command line, and without
        # the Secret the gateway asks for no key.
        "env": [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": opts.secret_name, "key": API_KEY_SECRET_KEY, "optional": True}}}],
        "ports": [{"name": name, "containerPort": port} for name, port in
                  {**_service_ports(opts), "health": opts.health_port}.items()],
        "resources": {"requests": resources, "limits": resources},
        "startupProbe": probe(READY_PATH, STARTUP_PERIOD_S,
                              math.ceil(STARTUP_WINDOW_S / STARTUP_PERIOD_S)),
        # 503 while serve restarts a faulty server or the end-to-end probe fails: the pod
        # leaves the Service's endpoints until it answers again.
        "readinessProbe": probe(READY_PATH, 5, 2),
        "livenessProbe": probe(LIVE_PATH, 10, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
        "volumeMounts": [repo_mount, {"name": "dshm", "mountPath": str(SHM_DIR)}],
    }
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        # A new pod starts before an old one stops: a rollout needs a spare GPU node and
        # waits (the old pods keep serving) until one is free.
        "strategy": {"type": "RollingUpdate",
                     "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {"metadata": {"labels": labels}, "spec": {
            "nodeSelector": {GPU_PRODUCT_LABEL: needs.gpu_product},
            # GPU nodes are often tainted so that only pods asking for GPUs land there.
            "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists",
                             "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": GRACE_S,
            # The pod's pause process becomes PID 1 and reaps what a killed tritonserver
            # orphans (python stubs, MPI helpers: serve restarts the server on a fault and
            # waits only for its own children; kubernetes build/pause/linux/pause.c sigreap).
            "shareProcessNamespace": True,
            # serve reads its settings from its arguments and API_KEY_ENV only: no Service
            # environment variables, no API token.
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "containers": [container],
            "volumes": [{"name": "repository", **volume},
                        {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                      "sizeLimit": _bytes_quantity(
                                                          needs.shm_bytes)}}],
        }},
    }
    if not opts.hpa:  # the autoscaler owns the count; an apply would reset it
        spec = {"replicas": opts.replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def _autoscaler(opts: DeployOptions, meta: dict[str, Any]) -> dict[str, Any]:
    """Pods by the LLM's queue: the average over the pods of QUEUE_METRIC summed over each
    pod's series. The HPA reads it from the custom metrics API, which a metrics adapter
    (e.g. prometheus-adapter over a Prometheus that scrapes the pods' `metrics` port)
    serves; without one the HPA reports that it cannot get the metric and scales nothing."""
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": opts.name},
            "minReplicas": opts.replicas, "maxReplicas": opts.max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": QUEUE_METRIC},
                "target": {"type": "AverageValue",
                           "averageValue": _cpu_quantity(opts.target_pending)}}}]}}


def _cpu_quantity(value: float) -> int | str:
    """A Kubernetes quantity: whole numbers as integers, others in thousandths ("1500m")."""
    return int(value) if float(value).is_integer() else f"{math.ceil(value * 1000)}m"


def _bytes_quantity(nbytes: int) -> str:
    return f"{nbytes // GIB}Gi" if nbytes % GIB == 0 else f"{-(-nbytes // MIB)}Mi"


@dataclass(frozen=True)
class DeployResult:
    out: Path
    files: tuple[str, ...]
    needs: PodNeeds
    claim: str | None  # the claim the pods mount (None: a host path)
    secret: str

    @property
    def apply_command(self) -> str:
        return f"kubectl apply -f {self.out}"


def write_manifests(repo: Path, out: Path, opts: DeployOptions, *,
                    force: bool = False) -> DeployResult:
    """Write the manifests for the repository `repo` into the folder `out` (which must not
    exist unless `force`), all or nothing."""
    yaml = require("yaml", extra="deploy", why="write Kubernetes manifests")
    repo = Path(repo)
    if not repo.is_dir():
        raise ConfigError(f"--repo {repo} is not a folder; pass a model repository written by "
                          "`qvl-trt repo` or `qvl-trt build`")
    out = Path(out).absolute()
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; pass --force to replace it or pick another --out")
    plan = read_serve_plan(repo)
    needs = pod_needs(plan, opts)
    docs = manifests(opts, needs)
    header = {"deployment.yaml": [f"qvl-trt deploy of {plan.repo.name} "
                                  f"({', '.join(plan.ensembles)}); per pod:", *needs.notes]}

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # the labels written out each time, not as &id001 anchors

    with staged_dir(out) as staging:
        for name, doc in docs.items():
            text = "".join(f"# {line}\n" for line in header.get(name, ()))
            (staging / name).write_text(text + yaml.dump(doc, Dumper=Dumper, sort_keys=False))
    return DeployResult(out, tuple(docs), needs,
                        None if opts.host_path else opts.claim_name, opts.secret_name)
