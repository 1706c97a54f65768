"""Commands of the "Serve and measure" panel: serve, talk to and measure a deployment, and
package it (image, Kubernetes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from ..errors import ConfigError
from ..gateway.options import (
    API_KEY_ENV,
    AnswerCacheOptions,
    GatewayOptions,
    triton_grpc_address,
)
from ..serve.liveness import LivenessRules
from ..serve.options import ServeOptions
from ..serve.server import Ports
from .app import (
    LOCAL_GRPC_URL,
    JsonOpt,
    ServedModelOpt,
    UrlOpt,
    VideoFpsOpt,
    VideoOpt,
    command,
    read_media,
)

# The options' defaults are the dataclasses' (one home per default).
_SERVE, _GATEWAY, _CACHE = ServeOptions, GatewayOptions, AnswerCacheOptions
AnswerCacheOpt = Annotated[bool, typer.Option(
    help="Answer a deterministic request (temperature 0, top_k 1 or a seed) that repeats an "
    "earlier one from the gateway's answer cache, without generating it (docs/openai.md).")]


EndpointOpt = Annotated[str, typer.Option(
    help="Where requests go: `ensemble` (the build's ensemble), `bls` (its tensorrt_llm_bls "
         "model, the gateway's upstream: the same request) or `openai` (POST "
         "/v1/chat/completions through the gateway at --url http://HOST:PORT; its API key "
         "from $QVL_TRT_API_KEY).")]


@command(panel="Serve and measure")
def infer(
    prompt: Annotated[str, typer.Option(help="The question.", show_default=False)],
    url: UrlOpt = LOCAL_GRPC_URL,
    image: Annotated[list[Path] | None, typer.Option(
        help="Image file (repeat for several).")] = None,
    video: VideoOpt = None,
    video_fps: VideoFpsOpt = None,
    stream: Annotated[bool, typer.Option(help="Print the answer as it is generated.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float | None, typer.Option(help="Nucleus sampling.")] = None,
    top_k: Annotated[int | None, typer.Option(help="Top-k sampling.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    served_model: ServedModelOpt = "ensemble",
    endpoint: EndpointOpt = "ensemble",
    budget: Annotated[str | None, typer.Option(
        help="The images' visual budget: low, high, auto (OpenAI's detail) or pixel bounds, "
             "max_pixels=N, min_pixels=N:max_pixels=N, within the deployment's "
             "(docs/openai.md).")] = None,
    json_out: JsonOpt = False,
    json_schema: Annotated[Path | None, typer.Option(
        help="Guided decoding: the answer is JSON valid against the schema in this file.")]
    = None,
    regex: Annotated[str | None, typer.Option(
        help="Guided decoding: the answer matches this regular expression.")] = None,
    grammar: Annotated[Path | None, typer.Option(
        help="Guided decoding: the answer follows the EBNF grammar in this file (xgrammar's "
             "syntax, rule `root`).")] = None,
    any_json: Annotated[bool, typer.Option(
        "--json-object", help="Guided decoding: the answer is a JSON value.")] = False,
    compact: Annotated[bool, typer.Option(
        help="With --json-schema: send the schema as a grammar of its JSON without free "
             "whitespace (json_schema guides admit any amount, which a model can repeat "
             "until --max-tokens).")] = False,
) -> None:
    """Ask a deployment one question about images and videos; prints the answer, then time to
    first token, tokens/s and token counts. A guide (--json-schema, --regex, --grammar,
    --json-object) makes the answer take that structure and end when it is complete."""
    from ..chat_messages import parse_image_budget
    from ..client.bench import ask
    from ..client.generate import GenerateRequest, guide_of
    from .console import print_answer, print_piece

    images, videos = read_media(image, video)
    req = GenerateRequest(prompt, images, max_tokens, temperature, top_p, top_k, seed,
                          tuple(stop or ()), stream, videos, video_fps,
                          **guide_of(json_schema=json_schema, regex=regex, grammar=grammar,
                                     any_json=any_json, compact=compact),
                          image_budget=parse_image_budget(budget) if budget else None)
    answer = ask(url, req, model=served_model, endpoint=endpoint,
                 api_key=os.environ.get(API_KEY_ENV),
                 on_response=print_piece if stream and not json_out else None)
    answer.raise_if_failed()
    print_answer(answer, json_out=json_out, streamed=stream)


@command(panel="Serve and measure")
def bench(
    url: UrlOpt = LOCAL_GRPC_URL,
    images: Annotated[Path | None, typer.Option(help="Folder of images, sent in turn.")]
    = None,
    synthetic: Annotated[str | None, typer.Option(
        help="WIDTHxHEIGHT: random-noise images, a different one per request.")] = None,
    synthetic_video: Annotated[str | None, typer.Option(
        help="WIDTHxHEIGHTxFRAMES: MP4 clips of moving colour ramps at 2 fps (the model sees "
             "every frame), a different one per request.")] = None,
    videos_per_request: Annotated[int, typer.Option(
        help="Videos per request (with --synthetic-video).")] = 1,
    seed: Annotated[int | None, typer.Option(
        help="Repeat the --synthetic images and videos of a run with this seed (default: new "
             "ones every run, so the server's vision cache does not answer them).")] = None,
    concurrency: Annotated[str, typer.Option(help="Requests in flight, per level.")] = "1,4,16",
    requests: Annotated[int, typer.Option(help="Requests per concurrency level.")] = 32,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per request.")] = 128,
    prompt: Annotated[str, typer.Option(help="The question of every request.")]
    = "Describe this image.",
    images_per_request: Annotated[int, typer.Option(help="Images per request.")] = 1,
    warmup: Annotated[int, typer.Option(help="Unmeasured requests sent first.")] = 1,
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for bench.json, bench.csv "
                                      "and bench.png.")] = Path("bench-results"),
    allow_remote: Annotated[bool, typer.Option(help="Allow a server that is not on this "
                                               "machine.")] = False,
    served_model: ServedModelOpt = "ensemble",
    endpoint: EndpointOpt = "ensemble",
    fixed_length: Annotated[bool, typer.Option(
        help="Every request generates exactly --max-tokens tokens (min_tokens = max_tokens, "
             "the end token ignored), as AIPerf's fixed output length does.")] = False,
    budgets: Annotated[str | None, typer.Option(
        help="Image budgets to measure one after another, comma-separated: low, high, auto "
             "(OpenAI's detail), max_pixels=N, min_pixels=N:max_pixels=N; a table gives each "
             "one's visual tokens and TTFT, the reports go in a folder per budget.")] = None,
) -> None:
    """Benchmark a deployment at several concurrencies: TTFT, inter-token latency, request
    latency, throughput (genai-perf's definitions, see docs/deployment.md). Writes JSON, CSV and a
    PNG plot of latency vs throughput."""
    from ..client.bench import BenchSettings, image_source, run_budgets, synthetic_videos
    from ..client.bench_report import write_budget_reports
    from .console import bench_progress, bench_run_tables
    from .console import out as console

    source, name = image_source(images, synthetic, seed)
    videos = synthetic_videos(synthetic_video, seed) if synthetic_video else None
    settings = BenchSettings(url, concurrency, requests, max_tokens, prompt, images_per_request,
                             warmup, served_model, allow_remote, videos_per_request, endpoint,
                             os.environ.get(API_KEY_ENV), fixed_length, budgets or ())
    with bench_progress(settings) as on_done:
        reports = run_budgets(settings, source, source=name, on_done=on_done, videos=videos)
    for table in bench_run_tables(reports):
        console.print(table)
    paths = write_budget_reports(reports, out)
    console.print(f"wrote {', '.join(str(p) for p in paths)}")


@command(panel="Serve and measure")
def verify(
    cases: Annotated[Path, typer.Option(help="JSON (list) or JSON-lines file of cases: "
                                        "prompt, images, videos, video_fps, max_tokens, "
                                        "must_match, name.", show_default=False)],
    against: Annotated[str, typer.Option(help="`reference` (in-process PyTorch pipeline) or "
                                         "a second deployment's grpc://HOST:PORT.",
                                         show_default=False)],
    url: UrlOpt = LOCAL_GRPC_URL,
    model: Annotated[Path | None, typer.Option(
        "--model", "-m", help="HF checkpoint of the deployment (for --against reference).")]
    = None,
    llm_checkpoint: Annotated[Path | None, typer.Option(
        help="Converted TensorRT-LLM checkpoint for the reference (a build's "
        "llm_checkpoint folder) [default: convert --model on the fly].")] = None,
    must_match: Annotated[int | None, typer.Option(
        help="Leading tokens that must agree per case [default: all].")] = None,
    served_model: ServedModelOpt = "ensemble",
    json_out: JsonOpt = False,
) -> None:
    """Compare a deployment's greedy token ids with a reference, case by case; report the
    first divergence; exit 1 if any case differs within its must-match prefix."""
    from ..client.verify import verify_deployment
    from .console import out as console
    from .console import print_json, verify_json, verify_line

    def show(result) -> None:
        console.print(verify_line(result), highlight=False)

    results = verify_deployment(cases, url, against, served_model=served_model, model=model,
                                llm_checkpoint=llm_checkpoint, must_match=must_match,
                                on_case=None if json_out else show)
    failed = [r for r in results if not r.passed]
    if json_out:
        print_json(verify_json(results))
    else:
        console.print(f"{len(results) - len(failed)} of {len(results)} cases match")
    if failed:
        raise typer.Exit(1)


@command(panel="Serve and measure")
def agreement(
    cases: Annotated[Path, typer.Option(help="Cases file, as for `verify`.",
                                        show_default=False)],
    model: Annotated[Path, typer.Option("--model", "-m", help="The HF checkpoint both were "
                                        "converted from.", show_default=False)],
    baseline: Annotated[Path, typer.Option(help="Converted checkpoint to compare against "
                                           "(e.g. the fp16 build's llm_checkpoint).",
                                           show_default=False)],
    candidate: Annotated[Path, typer.Option(help="Converted checkpoint under test (e.g. a "
                                            "`--weights int8` build's llm_checkpoint).",
                                            show_default=False)],
    device: Annotated[str, typer.Option(help="Where the reference decoders run.")] = "cpu",
    json_out: JsonOpt = False,
) -> None:
    """Report how closely one converted checkpoint follows another (a weight-only INT8/INT4
    one against fp16): both run greedily by the reference decoder on the same cases; per case
    where the tokens first differ and the largest logit difference before that, then the
    greedy-token agreement. A report: exit 0 whatever it says."""
    from ..client.verify import checkpoint_agreement, load_cases
    from .console import agreement_lines, print_json
    from .console import out as console

    result = checkpoint_agreement(load_cases(cases), model, baseline, candidate, device=device)
    if json_out:
        print_json({"token_agreement": result.token_agreement,
                    "max_logit_diff": result.max_logit_diff,
                    "cases": [{"name": c.name, "first_divergence": c.first_divergence,
                               "max_logit_diff": c.max_logit_diff, "baseline": c.baseline,
                               "candidate": c.candidate} for c in result.cases]})
        return
    for line in agreement_lines(result):
        console.print(line, highlight=False, markup=False)


@command(panel="Serve and measure")
def image(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the Docker build "
                                      "context to.", show_default=False)],
    repo: Annotated[Path | None, typer.Option(
        help="The repository the image will serve: its vision engines decide whether "
        "TensorRT-RTX goes in, and the `docker run` line serves it.",
        show_default=False)] = None,
    rtx: Annotated[bool | None, typer.Option(
        "--rtx/--no-rtx", help="Install TensorRT-RTX, which GeForce profiles' vision engines "
        "run on [default: whether --repo has such an engine].", show_default=False)] = None,
    tag: Annotated[str | None, typer.Option(
        help="Image tag [default: qvl-trt:VERSION-rtx or -trt].", show_default=False)] = None,
    bake_repo: Annotated[bool, typer.Option(
        help="Copy --repo (engines, tokenizer, configs) into the image, which then serves it "
        "when run with no arguments, without a volume (`qvl-trt deploy --repo-in-image`).")]
    = False,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
) -> None:
    """Write the serving image recipe: a Dockerfile FROM the TensorRT-LLM container that adds
    exactly what qvl-trt's python models and `qvl-trt serve` import and the container lacks,
    pinned so that nothing it already has is upgraded; qvl-trt itself goes in as source.
    Print the `docker build` line, and the `docker run` line that serves --repo."""
    from ..deploy.image import write_serving_recipe
    from .console import image_lines
    from .console import out as console

    recipe = write_serving_recipe(out, repo=repo, rtx=rtx, tag=tag, bake_repo=bake_repo,
                                  force=force)
    for line in image_lines(recipe, repo):
        console.print(line, highlight=False, markup=False)


@command(panel="Serve and measure")
def serve(
    repository: Annotated[Path, typer.Argument(help="Model repository folder.",
                                               show_default=False)],
    http_port: Annotated[int, typer.Option(help="HTTP port.")] = _SERVE.ports.http,
    grpc_port: Annotated[int, typer.Option(help="gRPC port.")] = _SERVE.ports.grpc,
    metrics_port: Annotated[int, typer.Option(help="Prometheus metrics port.")]
    = _SERVE.ports.metrics,
    free_ports: Annotated[bool, typer.Option(
        help="Pick three free ports instead of the port options.")] = _SERVE.pick_free_ports,
    host: Annotated[str, typer.Option(
        help="Address to listen on (IPv4 or IPv6, e.g. :: ).")] = _SERVE.host,
    inference_host: Annotated[str | None, typer.Option(
        help="Address of Triton's HTTP and gRPC endpoints, which ask no key (127.0.0.1 keeps "
        "them to this machine, behind the gateway); metrics and health stay on --host "
        "[default: --host].", show_default=False)] = _SERVE.inference_host,
    world_size: Annotated[int | None, typer.Option(
        help="GPUs (tensor-parallel ranks) of the LLM engine: > 1 launches one tritonserver "
        "rank per GPU through mpirun [default: the engines' world size; a different value "
        "is refused].", show_default=False)] = _SERVE.world_size,
    log_file: Annotated[Path | None, typer.Option(
        help="Write the server's log here instead of the terminal.")] = _SERVE.log_file,
    log_verbose: Annotated[int, typer.Option(help="Triton's --log-verbose level.")]
    = _SERVE.log_verbose,
    health_port: Annotated[int | None, typer.Option(
        help="Answer GET /ready (200 once the end-to-end probe answered and while none "
        "failed since, every model instance and the gateway run and no restart is under way; "
        "a busy server is ready; else 503) and /live on this port [default: none].",
        show_default=False)] = _SERVE.health_port,
    openai_port: Annotated[int | None, typer.Option(
        help="Also run the OpenAI-compatible gateway and chat page (`qvl-trt gateway`) on "
        "this port, in front of the server's gRPC endpoint; its /ready answers as "
        "--health-port's does; QVL_TRT_API_KEY in the environment makes it ask for that key "
        "[default: none].", show_default=False)] = _SERVE.openai_port,
    openai_host: Annotated[str | None, typer.Option(
        help="Address the gateway listens on [default: --host].", show_default=False)]
    = _SERVE.openai_host,
    keys_file: Annotated[Path | None, typer.Option(
        help="The gateway's tenants, API keys, quotas and cache scopes (`qvl-trt keys add`), "
        "instead of QVL_TRT_API_KEY's one key; reread when it changes.",
        show_default=False)] = _SERVE.keys_file,
    drain_timeout: Annotated[float, typer.Option(
        help="After SIGTERM or Ctrl-C, seconds the requests in flight get to finish; then "
        "they are cut and serve exits 1 (a finished drain exits 0).")]
    = _SERVE.drain_timeout_s,
    probe_interval: Annotated[float, typer.Option(
        help="Seconds from one end-to-end probe's answer to the next.")]
    = _SERVE.liveness.probe_interval_s,
    stall_timeout: Annotated[float, typer.Option(
        help="Restart the server when a probe has waited this many seconds and the server "
        "made no progress (no tensorrt_llm iteration, no request finished) since it was sent; "
        "a probe that waits while the server progresses means busy.")]
    = _SERVE.liveness.stall_timeout_s,
    probe_deadline: Annotated[float, typer.Option(
        help="Restart the server when a probe has waited this many seconds whatever the "
        "progress (a model that holds the requests it has while others go on).")]
    = _SERVE.liveness.probe_deadline_s,
    answer_cache: AnswerCacheOpt = _SERVE.answer_cache,
    warm_up: Annotated[bool, typer.Option(
        help="Before reporting ready, send each ensemble one small request with an image, so "
        "the first client's request finds the models warm (Triton's request counters count "
        "it).")] = _SERVE.warm_up,
    dry_run: Annotated[bool, typer.Option(
        help="Print the command it would run, and exit.")] = False,
) -> None:
    """Run tritonserver on a repository (PATH, /opt/tritonserver or the nvidia-pytriton
    binary); wait until it is ready, print its addresses, restart it when a model dies or
    stops answering (never because it is busy: docs/deployment.md), stop it cleanly on Ctrl-C
    or SIGTERM (a second one forces it). With
    --openai-port, the gateway starts once the server is ready, starts again if it exits on
    its own, and stops before the server."""
    from ..serve.run import prepare
    from ..serve.run import serve as serve_repository
    from .console import out as console
    from .console import serving_lines

    opts = ServeOptions(Ports(http_port, grpc_port, metrics_port), free_ports, host,
                        inference_host, world_size, log_file, log_verbose, health_port,
                        openai_port, openai_host, api_key=os.environ.get(API_KEY_ENV),
                        keys_file=keys_file, drain_timeout_s=drain_timeout,
                        liveness=LivenessRules(probe_interval, stall_timeout, probe_deadline),
                        answer_cache=answer_cache, warm_up=warm_up)
    if dry_run:
        console.print(prepare(repository, opts).command, highlight=False, markup=False,
                      soft_wrap=True)
        return
    code = serve_repository(repository, opts, on_ready=lambda *up: console.print(
        serving_lines(*up, health_port=health_port), highlight=False))
    if code:
        raise typer.Exit(code)


@command(panel="Serve and measure")
def deploy(
    repo: Annotated[Path, typer.Option(
        help="trt model repository (`qvl-trt repo` / `qvl-trt build`) the pods serve.",
        show_default=False)],
    image: Annotated[str, typer.Option(
        help="Serving image with `qvl-trt` and `tritonserver` on PATH, e.g. "
        "registry.example.com/qvl-trt-serve:4090d.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder to write the manifests into.",
                                      show_default=False)],
    name: Annotated[str | None, typer.Option(
        help="Name of the Deployment, the Service and the rest [default: qvl-trt].",
        show_default=False)] = None,
    namespace: Annotated[str | None, typer.Option(
        help="Namespace [default: kubectl's current one].", show_default=False)] = None,
    replicas: Annotated[int | None, typer.Option(
        "--replicas", "--min-replicas",
        help="Pods, each a whole server on one node; with --hpa the autoscaler's minimum, at "
        "least one, so that a warm pod always answers [default: one].",
        show_default=False)] = None,
    openai_port: Annotated[int | None, typer.Option(
        help="Port of the OpenAI gateway in the pod and the Service [default: the gateway's "
        "default port].", show_default=False)] = None,
    health_port: Annotated[int | None, typer.Option(
        help="serve's --health-port, which the probes ask [default: the port after Triton's "
        "three].", show_default=False)] = None,
    mount_path: Annotated[str | None, typer.Option(
        help="Where the pods see the repository [default: the path it was written for; "
        "another needs `qvl-trt repo --mount-path`].", show_default=False)] = None,
    claim: Annotated[str | None, typer.Option(
        help="PersistentVolumeClaim holding the repository, mounted read-only (ReadOnlyMany "
        "for pods on several nodes) [default: NAME-repository].", show_default=False)] = None,
    claim_path: Annotated[str, typer.Option(
        help="The repository's folder inside the claim [default: its root].",
        show_default=False)] = "",
    host_path: Annotated[str | None, typer.Option(
        help="Instead of a claim: the repository's folder on every GPU node.",
        show_default=False)] = None,
    repo_in_image: Annotated[bool, typer.Option(
        help="--image carries the repository (`qvl-trt image --bake-repo`): no volume, no "
        "claim.")] = False,
    gpu_product: Annotated[str | None, typer.Option(
        help="Value of the nvidia.com/gpu.product node label to schedule on (or the NVML "
        "device name, which becomes it) [default: the GPU profile's gpu.product].",
        show_default=False)] = None,
    cpu: Annotated[float | None, typer.Option(
        help="CPU cores per pod [default: one per process the pod runs].",
        show_default=False)] = None,
    memory_gib: Annotated[float | None, typer.Option(
        help="Memory per pod in GiB [default: /dev/shm + the engines + an allowance per "
        "process].", show_default=False)] = None,
    hpa: Annotated[bool, typer.Option(
        help="Also a HorizontalPodAutoscaler on qvl_llm_requests_waiting, the requests waiting "
        "for a batch slot (needs a custom metrics adapter, e.g. prometheus-adapter).")] = False,
    max_replicas: Annotated[int | None, typer.Option(
        help="The autoscaler's maximum pods [default: four].", show_default=False)] = None,
    target_pending: Annotated[float | None, typer.Option(
        help="The autoscaler's target: requests waiting per pod, on average [default: two].",
        show_default=False)] = None,
    api_key_secret: Annotated[str | None, typer.Option(
        help="Secret whose key `api-key` the gateway asks clients for; the pods wait until it "
        "exists [default: NAME-api-key].", show_default=False)] = None,
    no_api_key: Annotated[bool, typer.Option(
        help="The gateway asks no key: anyone who reaches the Service may use it.")] = False,
    keys_secret: Annotated[str | None, typer.Option(
        help="Instead of one key: the Secret whose key `keys.json` is a keys file of tenants "
        "(`qvl-trt keys add`), mounted into the pods; the gateway takes its updates without "
        "a restart.", show_default=False)] = None,
    expose_triton: Annotated[bool, typer.Option(
        help="Also Triton's HTTP and gRPC endpoints in the Service, which ask no key; the "
        "NetworkPolicy admits only pods labelled qvl-trt/triton-client=NAME to them.")] = False,
    ipv6: Annotated[bool, typer.Option(
        help="Listen on IPv6 (a single-stack IPv6 cluster).")] = False,
    drain_timeout: Annotated[float | None, typer.Option(
        help="serve's --drain-timeout in the pods: seconds the answers in flight get to finish "
        "at a rollout; the termination grace period follows [default: 120].",
        show_default=False)] = None,
    monitoring: Annotated[bool, typer.Option(
        help="Also a PodMonitor and a PrometheusRule (Prometheus Operator) and a Grafana "
        "dashboard, as a ConfigMap for Grafana's sidecar and as JSON in grafana/.")] = False,
    answer_cache: AnswerCacheOpt = _CACHE.enabled,
    force: Annotated[bool, typer.Option(help="Replace an existing --out folder.")] = False,
) -> None:
    """Write Kubernetes manifests that serve a trt repository with `qvl-trt serve`: a
    Deployment on the repository's GPU (its world size in GPUs, /dev/shm, CPU and memory from
    the repository, probes on serve's /ready and /live), a Service, a PodDisruptionBudget and
    optionally an autoscaler and the monitoring. Prints the `kubectl apply` line."""
    from ..deploy.kubernetes import DeployOptions, write_manifests
    from .console import deploy_lines
    from .console import out as console

    opts = DeployOptions.given(
        image=image, name=name, namespace=namespace, replicas=replicas, openai_port=openai_port,
        health_port=health_port, mount_path=mount_path, claim=claim, claim_path=claim_path,
        host_path=host_path, repo_in_image=repo_in_image, gpu_product=gpu_product, cpu=cpu,
        memory_gib=memory_gib, hpa=hpa, max_replicas=max_replicas,
        target_pending=target_pending, api_key_secret=api_key_secret, no_api_key=no_api_key,
        keys_secret=keys_secret, expose_triton=expose_triton, ipv6=ipv6,
        drain_timeout_s=drain_timeout, monitoring=monitoring, answer_cache=answer_cache)
    result = write_manifests(repo, out, opts, force=force)
    for line in deploy_lines(result, repo):
        console.print(line, highlight=False, markup=False)


@command(panel="Serve and measure")
def gateway(
    url: Annotated[str, typer.Option(help="Triton's gRPC endpoint: grpc://HOST:PORT.")]
    = LOCAL_GRPC_URL,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = _GATEWAY.host,
    port: Annotated[int, typer.Option(help="Port to listen on.")] = _GATEWAY.port,
    max_concurrency: Annotated[int | None, typer.Option(
        help="Chat requests sent on to Triton at once [default: with a keys file of several "
        "tenants the builds' batch slots, else what the builds admit, batch slots and queue "
        "places (`qvl-trt repo --max-queue`)].",
        show_default=False)] = _GATEWAY.max_concurrency,
    max_queue: Annotated[int | None, typer.Option(
        help="Chat requests that may wait in the gateway for one of those, served fairly "
        "across tenants; more get 429 [default: with several tenants the builds' queue "
        "places, else none].", show_default=False)]
    = _GATEWAY.max_queue,
    keys_file: Annotated[Path | None, typer.Option(
        help="Tenants' API keys, quotas and cache scopes (`qvl-trt keys add`); reread when "
        "it changes [default: the one key of $QVL_TRT_API_KEY, or none].",
        show_default=False)] = _GATEWAY.keys_file,
    max_body_bytes: Annotated[int | None, typer.Option(
        help="Largest request body; larger get 413 [default: the deployment's "
        "max_request_bytes + 64 KiB].", show_default=False)] = _GATEWAY.max_body_bytes,
    shutdown_timeout: Annotated[float, typer.Option(
        help="Seconds the answers in flight get to finish after SIGTERM.")]
    = _GATEWAY.shutdown_timeout_s,
    ready_url: Annotated[str | None, typer.Option(
        help="Answer /ready with what this URL's /ready answers (`qvl-trt serve` passes its "
        "own) [default: whether Triton's models are ready].", show_default=False)]
    = _GATEWAY.ready_url,
    answer_cache: AnswerCacheOpt = _CACHE.enabled,
    answer_cache_entries: Annotated[int, typer.Option(
        help="Most answers the answer cache holds (least recently used out first).")]
    = _CACHE.max_entries,
    answer_cache_mib: Annotated[float, typer.Option(
        help="Most MiB the answer cache holds.")] = _CACHE.max_mib,
    answer_cache_ttl: Annotated[float, typer.Option(
        help="Seconds a cached answer is kept.")] = _CACHE.ttl_s,
    answer_cache_tools: Annotated[bool, typer.Option(
        help="Cache the answers of requests with tools too.")] = _CACHE.tools,
) -> None:
    """OpenAI-compatible endpoint and chat page in front of a running Triton (`qvl-trt serve`,
    or the container): POST /v1/chat/completions, GET /v1/models, the chat page at /, /ready,
    /live and /metrics. With the environment variable QVL_TRT_API_KEY set, /v1/ asks for that
    key (Authorization: Bearer KEY); QVL_TRT_TRITON_ADMIN_KEY is the key of a Triton whose
    repository API is restricted (serve passes its own). Stops on Ctrl-C or SIGTERM."""
    from ..gateway.app import run_gateway
    from ..triton.restricted import ADMIN_KEY_ENV
    from .console import gateway_line
    from .console import out as console

    opts = GatewayOptions(triton_grpc_address(url), host=host, port=port,
                          max_concurrency=max_concurrency, max_queue=max_queue,
                          keys_file=keys_file, max_body_bytes=max_body_bytes,
                          shutdown_timeout_s=shutdown_timeout,
                          api_key=os.environ.get(API_KEY_ENV), ready_url=ready_url,
                          triton_admin_key=os.environ.get(ADMIN_KEY_ENV),
                          answer_cache=AnswerCacheOptions(
                              answer_cache, answer_cache_entries, answer_cache_mib,
                              answer_cache_ttl, answer_cache_tools))
    run_gateway(opts, on_ready=lambda: console.print(gateway_line(opts), highlight=False))


KEYS_ACTIONS = ("add", "list", "remove")


@command(panel="Serve and measure")
def keys(
    action: Annotated[str, typer.Argument(help="add (prints the new key, once), list or "
                                          "remove.", show_default=False)],
    keys_file: Annotated[Path, typer.Option(help="The keys file (JSON; created by the first "
                                            "add).", show_default=False)],
    tenant: Annotated[str | None, typer.Option(
        help="add: the key's tenant (created, or its settings below replaced).",
        show_default=False)] = None,
    key_id: Annotated[str | None, typer.Option(
        "--id", help="remove: the key's id as `list` shows it (or its start).",
        show_default=False)] = None,
    requests_per_minute: Annotated[int | None, typer.Option(
        help="add: the tenant's requests per minute [default: no limit].",
        show_default=False)] = None,
    tokens_per_minute: Annotated[int | None, typer.Option(
        help="add: the tenant's prompt + completion tokens per minute [default: no limit].",
        show_default=False)] = None,
    max_streams: Annotated[int | None, typer.Option(
        help="add: the tenant's requests in flight at once [default: no limit].",
        show_default=False)] = None,
    cache_scope: Annotated[str | None, typer.Option(
        help="add: whose caches the tenant's requests use: tenants of one scope share "
        "them, \"\" is the shared scope of requests without one [default: the tenant's "
        "name].", show_default=False)] = None,
) -> None:
    """Manage the gateway's tenants and API keys (`qvl-trt gateway --keys-file`): the file
    holds each key's sha256 only, with its tenant's quotas and cache scope; a running gateway
    takes a rewritten file within a second, without a restart."""
    from ..gateway.tenants import Quotas, add_key, read_keys, remove_key
    from .console import key_added_line, key_removed_line, keys_lines
    from .console import out as console

    if action not in KEYS_ACTIONS:
        raise ConfigError(f"keys {action}: the action is one of {', '.join(KEYS_ACTIONS)}")
    if action == "add":
        if tenant is None:
            raise ConfigError("keys add needs --tenant NAME: the tenant the key is for")
        quotas = Quotas(requests_per_minute, tokens_per_minute, max_streams)
        key, entry = add_key(keys_file, tenant, quotas, cache_scope)
        console.print(key_added_line(entry, keys_file), highlight=False)
        typer.echo(key)
    elif action == "remove":
        entry = remove_key(keys_file, key_id or "")
        console.print(key_removed_line(entry, keys_file), highlight=False)
    else:
        for line in keys_lines(read_keys(keys_file)):
            typer.echo(line)
