"""Kubernetes manifests for a generated model repository (`qvl-trt deploy`).

One folder for `kubectl apply -f`: a Deployment whose pods run `qvl-trt serve` (tritonserver
under its supervisor, the OpenAI gateway and the readiness endpoint) from the serving image on
nodes with the repository's GPU, as Pod Security "restricted" admits them; a Service in front
of the gateway and the metrics; a NetworkPolicy that admits nothing else; a
PodDisruptionBudget; optionally a HorizontalPodAutoscaler on the LLM's queue. Triton's own
HTTP and gRPC endpoints ask no key: they listen on the pod's loopback interface unless
`expose_triton`, and then only pods labelled TRITON_CLIENT_LABEL may reach them. What a pod needs
is read from the repository (`read_needs`). Each pod is a whole server on one node (a
tensor-parallel engine's ranks share it); scaling past one node is replicas behind the
Service.

The repository is mounted read-only, or carried by the image (`repo_in_image`: `qvl-trt image
--bake-repo`, no volume, no claim), at the path it was written for (`qvl-trt repo
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
from ..gateway.options import API_KEY_ENV, DEFAULT_PORT, AnswerCacheOptions
from ..gateway.readiness import LIVE_PATH, READY_PATH
from ..profiles import check_gpu_product, gpu_product_label
from ..serve.gateway_process import STOP_GRACE_S
from ..serve.liveness import LivenessRules
from ..serve.load_time import (
    STARTUP_FLOOR_S,
    STARTUP_MARGIN,
    read_load_time,
    startup_window_s,
)
from ..serve.needs import (
    ServeNeeds,
    read_needs,
    resolve_world_size,
    shm_gib,
    written_root,
)
from ..serve.server import SHM_DIR, STARTUP_TIMEOUT_S, UNLOAD_GRACE_S, Ports, client_host
from ..serve.supervisor import START_ATTEMPTS
from ..triton import contract as c
from ..triton.contract import POSTPROCESSING, PREPROCESSING, TENSORRT_LLM_BLS
from . import monitoring
from .image import HEALTH_PORT, SERVE_GID, SERVE_UID, serve_arguments

MIB, GIB = 2**20, 2**30
DEFAULT_NAME = "qvl-trt"
CONTAINER = "serve"  # the pod's one container
API_KEY_SECRET_KEY = "api-key"  # the key of the Secret that holds the API key
# With --keys-secret: the Secret's key holding the gateway's keys file (gateway/tenants.py),
# mounted as a folder (not a subPath, which the kubelet never updates) so that a changed
# Secret reaches the running gateway (the kubelet swaps the folder's `..data` symlink).
KEYS_SECRET_KEY = "keys.json"
KEYS_DIR = "/etc/qvl-trt/keys"
# Pods that may reach Triton's HTTP and gRPC endpoints (with expose_triton): this label with
# the deployment's name as its value.
TRITON_CLIENT_LABEL = "qvl-trt/triton-client"
# Where the pod writes, its root file system being read-only: emptyDir volumes.
TMP_DIR = "/tmp"
CACHE_DIR = "/var/cache/qvl-trt"  # the pixel kernel cache (NUMBA_CACHE_DIR) and other caches
# The device plugin's resource and GPU feature discovery's product label
# (NVIDIA/k8s-device-plugin internal/lm/resource.go: fullGPUResourceName, "product").
GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# The requests waiting for a batch slot of the pod's LLM, per caller instance (summed per
# pod by the metrics adapter; triton/runtime/postprocessing.py QueueMetrics). Not Triton's
# nv_inference_pending_request_count: it counts a request from PENDING until a model instance
# executes it (core infer_request.cc), and the decoupled models here and the stock
# tensorrtllm backend take every request at once and queue it themselves, so it stays at 0.
QUEUE_METRIC = c.LLM_REQUESTS_WAITING

# Host memory per process, requested and limited alike (see pod_needs): 1.5x the peak resident
# memory measured under load (docs/benchmarks.md, "Served processes' memory":
# scripts/measure_serve_memory.py, 2x more streams than slots, 3000-token answers, 12 MP
# images, video, guides), less the /dev/shm pages, which the pod's /dev/shm volume counts.
SERVE_BYTES = 192 * MIB  # serve itself: the supervisor and the health endpoint (peak 121 MiB)
GATEWAY_BYTES = 832 * MIB  # base64 bodies and xgrammar (peak 543 MiB)
PROCESS_BYTES = {  # a python model instance of each kind, a stub process without CUDA
    PREPROCESSING: 1088 * MIB,  # decoding, resizing, the tokenizer, numba (peak 690 MiB)
    POSTPROCESSING: 192 * MIB,  # detokenizing (peak 101 MiB)
    TENSORRT_LLM_BLS: 512 * MIB,  # its own part; plus BLS_TABLE_SHARE, below
}
# tensorrt_llm_bls relays every request's prompt and MRoPE tables: its private memory grew with
# their width (439 MiB with the builds' shm_bytes 1.93 GiB, 1086 MiB with 5.09 GiB), about a
# fifth of what the builds size /dev/shm for; a quarter of shm_bytes, summed over its instances.
BLS_TABLE_SHARE = 0.25
# A process with a CUDA context and TensorRT or TensorRT-LLM loaded (each tritonserver rank,
# each vision_encoder instance): an allowance, not measured (no GPU here) and published
# nowhere upstream; a CUDA context alone takes a few hundred MiB of host memory, the
# libraries' pages more once touched. tritonserver's own part measured 136 MiB.
CUDA_PROCESS_BYTES = 2 * GIB

# The startup probe asks /ready every STARTUP_PERIOD_S for the repository's startup window
# (serve/load_time.py: sized from its measured starts, or serve's whole retry budget).
STARTUP_PERIOD_S = 10
# Endpoints and proxies drop a terminating pod asynchronously: it keeps serving this long
# after it is told to stop, before SIGTERM.
PRESTOP_S = 5
# On SIGTERM serve drains the gateway first (the drain timeout, then STOP_GRACE_S until it is
# killed), then tritonserver (the drain timeout again, for clients of its own endpoints, then
# UNLOAD_GRACE_S); the kubelet's grace period counts from the preStop hook and must cover all
# of it.
DRAIN_MARGIN_S = 10
# A rollout's drain: long enough for a long answer to finish (4000 tokens at 40 tokens/s a
# stream on a loaded server take 100 s), where serve's own default (10 s) would cut it.
DEPLOY_DRAIN_S = 120.0
# With monitoring: the dashboard for Grafana's import, beside its ConfigMap.
DASHBOARD_FILE = "grafana/{name}.json"


def grace_period_s(drain_timeout_s: float) -> int:
    return math.ceil(PRESTOP_S + drain_timeout_s + STOP_GRACE_S + drain_timeout_s
                     + UNLOAD_GRACE_S + DRAIN_MARGIN_S)

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
    replicas: int = 1  # with the autoscaler: its minimum (--min-replicas)
    openai_port: int = DEFAULT_PORT
    health_port: int = HEALTH_PORT
    mount_path: str | None = None  # None: the path the repository was written for
    claim: str | None = None  # PersistentVolumeClaim holding the repository [NAME-repository]
    claim_path: str = ""  # the repository's folder inside the claim ("" = its root)
    host_path: str | None = None  # instead of a claim: the repository's folder on each node
    repo_in_image: bool = False  # the image carries the repository: no volume at all
    gpu_product: str | None = None  # None: the profile's gpu.product
    cpu: float | None = None  # None: derived (pod_needs)
    memory_gib: float | None = None  # None: derived (pod_needs)
    hpa: bool = False
    max_replicas: int = 4
    target_pending: float = 2.0  # the autoscaler's average queued requests per pod
    api_key_secret: str | None = None  # Secret holding the gateway's key [NAME-api-key]
    no_api_key: bool = False  # the gateway asks no key (instead of the Secret's)
    keys_secret: str | None = None  # Secret holding a keys file of tenants (instead)
    expose_triton: bool = False  # Triton's HTTP and gRPC in the Service, for labelled pods
    ipv6: bool = False  # listen on IPv6 (a single-stack IPv6 cluster)
    drain_timeout_s: float = DEPLOY_DRAIN_S  # serve's --drain-timeout in the pods
    monitoring: bool = False  # a PodMonitor, a PrometheusRule and a Grafana dashboard too
    answer_cache: bool = AnswerCacheOptions.enabled  # the gateway's (serve's --answer-cache)

    def __post_init__(self) -> None:
        if not self.image or any(ch.isspace() for ch in self.image):
            raise ConfigError(f"--image {self.image!r} is empty or has blanks; give the serving "
                              "image's reference, e.g. registry.example.com/qvl-trt-serve:4090d")
        _name(self.name, _DNS1035, "--name", "a lowercase DNS label starting with a letter "
              "(letters, digits, '-'; at most 63)")
        if self.namespace is not None:
            _name(self.namespace, _DNS1123_LABEL, "--namespace",
                  "a lowercase DNS label (letters, digits, '-'; at most 63)")
        for option, value in (("--claim", self.claim), ("--api-key-secret", self.api_key_secret),
                              ("--keys-secret", self.keys_secret)):
            if value is not None:
                _name(value, _DNS1123_SUBDOMAIN, option,
                      "a lowercase DNS name (letters, digits, '-', '.')")
        if self.replicas < 1:
            raise ConfigError(f"--replicas {self.replicas} must be at least 1 (with --hpa, "
                              "--min-replicas: the autoscaler keeps a warm pod, as one started "
                              "on demand answers only once it has loaded)")
        if self.hpa and self.max_replicas < self.replicas:
            raise ConfigError(f"--max-replicas {self.max_replicas} is below --replicas "
                              f"{self.replicas} (the autoscaler's minimum); raise it")
        if self.target_pending <= 0:
            raise ConfigError(f"--target-pending {self.target_pending} must be positive")
        if self.no_api_key and self.api_key_secret is not None:
            raise ConfigError("--no-api-key and --api-key-secret contradict each other; give "
                              "one: the Secret whose key the gateway asks, or no key at all")
        if self.keys_secret is not None and (self.no_api_key or self.api_key_secret):
            raise ConfigError("--keys-secret gives the gateway its keys: leave out "
                              "--no-api-key and --api-key-secret")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout {self.drain_timeout_s} must be >= 0")
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
        if self.repo_in_image and (self.claim or self.claim_path or self.host_path):
            raise ConfigError("--repo-in-image: the image carries the repository (`qvl-trt "
                              "image --bake-repo`); drop --claim, --claim-path and --host-path")
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

    @classmethod
    def given(cls, **options: Any) -> DeployOptions:
        """The options a command line gives, None standing for the default."""
        return cls(**{k: v for k, v in options.items() if v is not None})

    @property
    def claim_name(self) -> str:
        return self.claim or f"{self.name}-repository"

    @property
    def secret_name(self) -> str | None:
        """The Secret the gateway's one key comes from; None: no key, or a keys file."""
        if self.no_api_key or self.keys_secret is not None:
            return None
        return self.api_key_secret or f"{self.name}-api-key"

    @property
    def listen_host(self) -> str:
        """serve's --host in the pod: every address (the probes, the gateway, metrics)."""
        return "::" if self.ipv6 else "0.0.0.0"

    @property
    def inference_host(self) -> str:
        """serve's --inference-host: Triton's HTTP and gRPC, which ask no key, on the loopback
        interface unless exposed."""
        return self.listen_host if self.expose_triton else client_host(self.listen_host)


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
    startup_s: float  # how long the startup probe waits for /ready (startup_window_s)
    cpu: float
    memory_bytes: int
    notes: tuple[str, ...]  # one line per derived figure


def pod_needs(plan: ServeNeeds, opts: DeployOptions) -> PodNeeds:
    """GPUs, node label, mount path, /dev/shm, CPU and memory of one pod serving `plan`.

    CPU: one core per process that works at once, each python model instance (a stub process
    running one request at a time), each tritonserver rank and the gateway, as a request with
    no limit: a CFS quota throttles the executor's loop and the stubs in bursts (a request's
    preprocessing is one burst), which shows as latency while the node has idle cores.
    Memory, requested and limited alike (a limit is what keeps one pod's growth from evicting
    its neighbours): the memory-backed /dev/shm (its files count against the pod's memory
    limit; Kubernetes' EmptyDirVolumeSource.sizeLimit), the engines' bytes (each is read into
    host memory to be deserialized) and an allowance per process, measured where this
    machine runs it (SERVE_BYTES, GATEWAY_BYTES, PROCESS_BYTES, BLS_TABLE_SHARE) and
    CUDA_PROCESS_BYTES for the GPU processes, rounded up to GiB.
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
    notes = [f"GPUs: {gpus}, the LLM engine's world size (one tritonserver rank per GPU), "
             f"on nodes labelled {GPU_PRODUCT_LABEL}={product}"]
    if opts.cpu is None:
        cpu = float(stubs + gpus + 1)
        notes.append(f"CPU: {cpu:g} requested, one per python model instance ({stubs}), "
                     f"tritonserver rank ({gpus}) and the gateway (1); no limit")
    else:
        cpu = opts.cpu
        notes.append(f"CPU: {cpu:g} (--cpu)")
    if opts.memory_gib is None:
        stub_bytes = sum(count * _process_bytes(model) for model, count in plan.instances.items()
                         if model not in plan.vision_editions)
        tables = round(plan.shm_bytes * BLS_TABLE_SHARE) if any(
            _kind(m) == TENSORRT_LLM_BLS for m in plan.instances) else 0
        need = (shm + plan.engine_bytes + SERVE_BYTES + GATEWAY_BYTES + stub_bytes + tables
                + cuda * CUDA_PROCESS_BYTES)
        memory = -(-need // GIB) * GIB
        notes.append(
            f"memory: {memory // GIB} GiB, /dev/shm {shm // GIB} GiB + engines "
            f"{plan.engine_bytes / GIB:.1f} GiB + serve and the gateway "
            f"{(SERVE_BYTES + GATEWAY_BYTES) // MIB} MiB + {stubs - vision} python model instances "
            f"{(stub_bytes + tables) // MIB} MiB (measured, docs/benchmarks.md) + "
            f"{CUDA_PROCESS_BYTES // GIB} GiB x {cuda} with CUDA, rounded up")
    else:
        memory = math.ceil(opts.memory_gib * GIB / MIB) * MIB
        if memory < shm + plan.engine_bytes:
            raise ConfigError(f"--memory-gib {opts.memory_gib:g} is below /dev/shm and the "
                              f"engines ({(shm + plan.engine_bytes) / GIB:.1f} GiB), which "
                              "count against the pod's memory; raise it")
        notes.append(f"memory: {opts.memory_gib:g} GiB (--memory-gib)")
    notes.append(f"/dev/shm: {shm // GIB} GiB in memory, for the python backend's tensors of "
                 "the largest requests in flight")
    load = read_load_time(repo)
    startup = startup_window_s(load)
    if load is None:
        notes.append(f"startup: up to {startup:.0f} s, serve's {START_ATTEMPTS} starts of "
                     f"{STARTUP_TIMEOUT_S:.0f} s, each with its first probe (the stall timeout, "
                     f"{LivenessRules.stall_timeout_s:.0f} s): no start of this repository "
                     "was measured (serve records each in it; serve it once, then deploy "
                     "again for a window sized from that)")
    else:
        notes.append(f"startup: up to {startup:.0f} s, {STARTUP_MARGIN:g}x the slowest of "
                     f"{load.starts} measured starts ({load.slowest_s:g} s to loaded and "
                     f"warmed up, on {load.host} at {load.measured}), at least "
                     f"{STARTUP_FLOOR_S:.0f} s")
    notes.append(f"termination: {grace_period_s(opts.drain_timeout_s)} s, the preStop pause, "
                 f"the gateway's and tritonserver's drains ({opts.drain_timeout_s:g} s each) "
                 "and a margin")
    return PodNeeds(gpus, product, written, shm, startup, cpu, memory, tuple(notes))


def _kind(model: str) -> str | None:
    """The step a python model is (ModelNames: the kind itself, or NAME_kind)."""
    return next((k for k in PROCESS_BYTES if model == k or model.endswith(f"_{k}")), None)


def _process_bytes(model: str) -> int:
    kind = _kind(model)
    return PROCESS_BYTES[kind] if kind else max(PROCESS_BYTES.values())


def _gpu_product(plan: ServeNeeds, opts: DeployOptions) -> str:
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
        "networkpolicy.yaml": _network_policy(opts, meta, labels),
        # maxUnavailable, not minAvailable: a single replica must not block node drains.
        "pdb.yaml": {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}}},
    }
    if opts.hpa:
        docs["hpa.yaml"] = _autoscaler(opts, meta)
    if opts.monitoring:
        docs |= monitoring.manifests(opts.name, meta, labels)
    return docs


def _service_ports(opts: DeployOptions) -> dict[str, int]:
    """The gateway (which asks the key) and the metrics (for scraping); Triton's HTTP and gRPC
    endpoints, which ask none, only when exposed."""
    triton = _triton_ports()
    open_ = {"openai": opts.openai_port, "metrics": triton["metrics"]}
    if opts.expose_triton:
        open_ |= {"http": triton["http"], "grpc": triton["grpc"]}
    return open_


def _network_policy(opts: DeployOptions, meta: dict[str, Any],
                    labels: dict[str, str]) -> dict[str, Any]:
    """Ingress to the pods: the gateway, metrics and health ports from anywhere; Triton's HTTP
    and gRPC (when exposed) from this namespace's pods labelled TRITON_CLIENT_LABEL=NAME
    alone. Enforced where the cluster's network plugin implements NetworkPolicy."""
    triton = _triton_ports()
    anyone = [{"port": port, "protocol": "TCP"} for port in
              (opts.openai_port, triton["metrics"], opts.health_port)]
    rules: list[dict[str, Any]] = [{"ports": anyone}]
    if opts.expose_triton:
        rules.append({"from": [{"podSelector": {"matchLabels": {TRITON_CLIENT_LABEL: opts.name}}}],
                      "ports": [{"port": triton[n], "protocol": "TCP"} for n in ("http", "grpc")]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"],
                     "ingress": rules}}


def _deployment(opts: DeployOptions, needs: PodNeeds, meta: dict[str, Any],
                labels: dict[str, str]) -> dict[str, Any]:
    mount = str(needs.mount_path)
    serve = serve_arguments(mount, host=opts.listen_host, inference_host=opts.inference_host,
                            openai_port=opts.openai_port, health_port=opts.health_port,
                            drain_timeout_s=opts.drain_timeout_s)
    serve += [] if opts.answer_cache else ["--no-answer-cache"]
    if opts.keys_secret is not None:
        serve += ["--keys-file", f"{KEYS_DIR}/{KEYS_SECRET_KEY}"]
    memory = _bytes_quantity(needs.memory_bytes)
    requests = {"cpu": _cpu_quantity(needs.cpu), "memory": memory, GPU_RESOURCE: needs.gpus}
    limits = {"memory": memory, GPU_RESOURCE: needs.gpus}
    # The repository's volume, read-only at the path it was written for: none when the image
    # carries it there.
    repo_mounts: list[dict[str, Any]] = []
    repo_volumes: list[dict[str, Any]] = []
    if not opts.repo_in_image:
        repo_mount: dict[str, Any] = {"name": "repository", "mountPath": mount,
                                      "readOnly": True}
        if opts.host_path is None:
            volume: dict[str, Any] = {"persistentVolumeClaim": {"claimName": opts.claim_name,
                                                                "readOnly": True}}
            if opts.claim_path:
                repo_mount["subPath"] = str(PurePosixPath(opts.claim_path))
        else:
            volume = {"hostPath": {"path": opts.host_path, "type": "Directory"}}
        repo_mounts.append(repo_mount)
        repo_volumes.append({"name": "repository", **volume})

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "health"}, "periodSeconds": period,
                "timeoutSeconds": 5, "failureThreshold": failures}

    container = {
        "name": CONTAINER,
        "image": opts.image,
        # args, not command: the image's entrypoint stays in front. The NGC containers' is
        # /opt/nvidia/nvidia_entrypoint.sh, which sources entrypoint.d/ (their environment
        # setup) and then execs its arguments, so serve still gets the kubelet's SIGTERM
        # (triton-inference-server/server docker/cpu_only/nvidia_entrypoint.sh).
        "args": serve,
        "env": _environment(opts),
        "ports": [{"name": name, "containerPort": port} for name, port in
                  {**_service_ports(opts), "health": opts.health_port}.items()],
        "resources": {"requests": requests, "limits": limits},
        "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True, "runAsNonRoot": True},
        # /ready turns 200 once the models are loaded and warmed up (serve/warmup.py) and the
        # first probe answered: the first request routed to the pod finds it warm.
        "startupProbe": probe(READY_PATH, STARTUP_PERIOD_S,
                              math.ceil(needs.startup_s / STARTUP_PERIOD_S)),
        # 503 while serve restarts a faulty server or the end-to-end probe fails: the pod
        # leaves the Service's endpoints until it answers again.
        "readinessProbe": probe(READY_PATH, 5, 2),
        "livenessProbe": probe(LIVE_PATH, 10, 3),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
        "volumeMounts": [*repo_mounts, {"name": "dshm", "mountPath": str(SHM_DIR)},
                         {"name": "tmp", "mountPath": TMP_DIR},
                         {"name": "cache", "mountPath": CACHE_DIR},
                         *([{"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}]
                           if opts.keys_secret else [])],
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
            "terminationGracePeriodSeconds": grace_period_s(opts.drain_timeout_s),
            # What Pod Security "restricted" asks, as the serving image's user (image.py).
            "securityContext": {"runAsNonRoot": True, "runAsUser": SERVE_UID,
                                "runAsGroup": SERVE_GID, "fsGroup": SERVE_GID,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            # The pod's pause process becomes PID 1 and reaps what a killed tritonserver
            # orphans (python stubs, MPI helpers: serve restarts the server on a fault and
            # waits only for its own children; kubernetes build/pause/linux/pause.c sigreap).
            "shareProcessNamespace": True,
            # serve reads its settings from its arguments and API_KEY_ENV only: no Service
            # environment variables, no API token.
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "containers": [container],
            "volumes": [*repo_volumes,
                        {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                      "sizeLimit": _bytes_quantity(
                                                          needs.shm_bytes)}},
                        {"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}},
                        *([{"name": "keys", "secret": {"secretName": opts.keys_secret}}]
                          if opts.keys_secret else [])],
        }},
    }
    if not opts.hpa:  # the autoscaler owns the count; an apply would reset it
        spec = {"replicas": opts.replicas, **spec}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def _environment(opts: DeployOptions) -> list[dict[str, Any]]:
    """HOME and the caches on the writable volumes; the gateway's key from its Secret (never
    on a command line), which the pod waits for: a missing Secret never means no key."""
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        {"name": "NUMBA_CACHE_DIR", "value": f"{CACHE_DIR}/numba"}]
    if opts.secret_name is not None:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": opts.secret_name, "key": API_KEY_SECRET_KEY}}})
    return env


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
    claim: str | None  # the claim the pods mount (None: a host path, or in the image)
    secret: str | None  # the Secret of the gateway's key (None: --no-api-key)

    opts: DeployOptions

    @property
    def apply_command(self) -> str:
        return f"kubectl apply -f {self.out}"

    @property
    def access(self) -> tuple[str, ...]:
        """Who may reach what, as `deploy` prints it."""
        if self.opts.keys_secret is not None:
            lines = [f"the gateway asks the keys of the keys file in the Secret "
                     f"{self.opts.keys_secret} (`qvl-trt keys add`), rereading it when the "
                     f"Secret changes; the pods wait until it exists: kubectl create secret "
                     f"generic {self.opts.keys_secret} --from-file={KEYS_SECRET_KEY}=KEYSFILE"]
        elif self.secret is None:
            lines = ["warning: the gateway asks NO key (--no-api-key): anyone who reaches the "
                     "Service's openai port may use it"]
        else:
            lines = [f"the gateway asks the key in the Secret {self.secret}; the pods wait "
                     f"until it exists: kubectl create secret generic {self.secret} "
                     f"--from-file={API_KEY_SECRET_KEY}=KEYFILE"]
        if self.opts.expose_triton:
            lines.append(f"Triton's HTTP and gRPC endpoints (no key) are in the Service, for "
                         f"pods labelled {TRITON_CLIENT_LABEL}={self.opts.name} (the "
                         "NetworkPolicy admits no others where the network plugin enforces it)")
        return tuple(lines)


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
    plan = read_needs(repo)
    needs = pod_needs(plan, opts)
    docs = manifests(opts, needs)
    header = {"deployment.yaml": [f"qvl-trt deploy of {plan.repo.name} "
                                  f"({', '.join(plan.ensembles)}); per pod:", *needs.notes]}

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # the labels written out each time, not as &id001 anchors

    files = tuple(docs)
    with staged_dir(out) as staging:
        for name, doc in docs.items():
            text = "".join(f"# {line}\n" for line in header.get(name, ()))
            (staging / name).write_text(text + yaml.dump(doc, Dumper=Dumper, sort_keys=False))
        if opts.monitoring:  # in a folder of its own: `kubectl apply -f` reads no subfolder
            dashboard = staging / DASHBOARD_FILE.format(name=opts.name)
            dashboard.parent.mkdir()
            dashboard.write_text(monitoring.dashboard_json(opts.name))
            files += (DASHBOARD_FILE.format(name=opts.name),)
    return DeployResult(out, files, needs,
                        None if opts.host_path or opts.repo_in_image else opts.claim_name,
                        opts.secret_name, opts)
