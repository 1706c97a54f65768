"""The trt flavor for real, in the TensorRT-LLM container (nvcr.io/nvidia/tritonserver:
26.07-trtllm-python-py3) on a GPU: the tiny checkpoint built end to end (vision engine with
full TensorRT, LLM engine with TensorRT-LLM), `qvl-trt repo` (trt flavor) passes validate,
the stock tensorrtllm backend serves it, and a streamed greedy answer starts with the
reference decoder's first token; guided requests (xgrammar in the executor, on the tokenizer
info the repository ships) give JSON that validates and text the regex matches, and a guide
that does not compile is refused. Run: scripts/verify_gpu.sh.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from gpu_tiers import trtllm_gpu_marks
from guided_cases import BAD_SCHEMA, PATTERN, SCHEMA
from PIL import Image

from qvl_trt.build import BuildOptions, run_build
from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
from qvl_trt.testing.small_profile import small_profile_toml
from qvl_trt.triton.repository import BuildInput, write_repo
from qvl_trt.triton.validate import validate_repo

torch = pytest.importorskip("torch")
pytestmark = trtllm_gpu_marks("TensorRT-LLM 1.2, the tensorrtllm Triton backend and a GPU")


def _profile_text() -> str:
    major, minor = torch.cuda.get_device_capability()
    return small_profile_toml(
        compute_capability=f"{major}.{minor}", trt_edition="tensorrt", max_batch_size=4,
        max_input_len=512, max_seq_len=640, max_num_tokens=2048,
        kv_cache_free_gpu_mem_fraction=0.3)


def test_trt_flavor_builds_validates_and_serves(tmp_path, tiny_ckpt) -> None:
    from qvl_trt.client.generate import GenerateClient, GenerateRequest
    from qvl_trt.client.verify import InProcessReference, StepwiseDeployment

    profile = tmp_path / "gpu.toml"
    profile.write_text(_profile_text())
    build = tmp_path / "build"
    run_build(BuildOptions(model=str(tiny_ckpt), gpu=str(profile)), build)
    assert sorted(p.name for p in (build / "repo").iterdir()) == ["reference", "trt"]
    repo = write_repo([BuildInput(build)], tmp_path / "repo").path
    report = validate_repo(repo)
    assert report.ok, report.problems

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), np.uint8)).save(
        buf, "PNG")
    request = GenerateRequest("What is in this picture?", (buf.getvalue(),), max_tokens=16)
    with TritonServer(ServerOptions(repo, free_ports()), log_file=tmp_path / "server.log",
                      startup_timeout_s=600) as server:
        client = GenerateClient(f"grpc://{server.grpc_url}")
        answer = client.generate(request)
        limits = client.request_limits()  # the deployment's, as `qvl-trt verify` reads them
        _guided_requests(client)
        client.close()
        assert (limits.max_input_len, limits.max_seq_len) == (512, 640)
        assert answer.completion_tokens > 0 and len(answer.responses) > 1
        deployment = StepwiseDeployment(f"grpc://{server.grpc_url}")
        tokens = deployment(request)
        deployment.close()
        _stock_progress_and_probe(server)
    reference = InProcessReference(tiny_ckpt, limits=limits,
                                   llm_checkpoint=build / "llm_checkpoint", device="cuda")
    # fp16 rounding may flip near-ties later on in a random-weight model: the first token.
    assert tokens[:1] == reference(request)[:1]




def _stock_progress_and_probe(server) -> None:
    """What serve's liveness rests on (serve/progress.py, liveness.py), from the stock
    backend: its iteration counter has counted the iterations it ran (stats every
    stats_check_period_ms), and a health probe answers through the ensemble."""
    import time

    from qvl_trt.serve.liveness import Outcome
    from qvl_trt.serve.progress import iterations, read_metrics
    from qvl_trt.serve.supervisor import probe
    from qvl_trt.triton import contract as c

    deadline = time.monotonic() + 30  # set from the latest stats, every stats period
    while iterations(read_metrics(server.metrics_url)) == 0:
        assert time.monotonic() < deadline, "the stock backend published no iteration"
        time.sleep(0.1)
    assert probe(server, c.ENSEMBLE, 60) == (Outcome.ANSWERED, "")


def _guided_requests(client) -> None:
    """Guided decoding in the stock backend: the schema as its compact grammar (a
    json_schema guide admits unbounded whitespace, which a random model pads with), a regex,
    and a schema xgrammar rejects (preprocessing refuses it)."""
    from qvl_trt.client.generate import GenerateRequest
    from qvl_trt.errors import RequestError
    from qvl_trt.llm.guided import compact_json_schema

    def ask(**guide):
        return client.generate(GenerateRequest("Describe a pet.", max_tokens=64, **guide))

    answer = ask(guide_type="ebnf_grammar", guide=compact_json_schema(json.dumps(SCHEMA)))
    value = json.loads(answer.text)  # validated by hand: the image has no jsonschema
    assert list(value) == SCHEMA["required"] and value["kind"] in ("cat", "dog")
    assert len(value["name"]) <= 4 and len(value["tags"]) <= 2
    assert all(len(t) <= 3 for t in value["tags"]) and value["owner"] in ({"ok": True},
                                                                           {"ok": False})
    assert answer.finish_reason == "stop"
    assert re.fullmatch(PATTERN, ask(guide_type="regex", guide=PATTERN).text)
    # refused by preprocessing: in the executor it would fail every request of its step
    with pytest.raises(RequestError, match="the json_schema guide does not compile"):
        ask(guide_type="json_schema", guide=BAD_SCHEMA)
