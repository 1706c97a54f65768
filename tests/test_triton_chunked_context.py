"""Chunked context through the served reference repository, with a real tritonserver: the
tiny build's repository with its engine's build config edited as if the engine had been
built with max_num_tokens 8 in KV blocks of 4. A prompt of text and an image, longer than
max_num_tokens, is answered with chunked context as the one-pass session server answers it;
after an operator sets enable_chunked_context false and reloads tensorrt_llm, the same
prompt is refused with the executor's message."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from qvl_trt.client.generate import GenerateClient, GenerateRequest
from qvl_trt.errors import RequestError
from qvl_trt.machine import find_tritonserver
from qvl_trt.manifest import BUILD_CONFIG_NAME
from qvl_trt.triton import contract as c
from qvl_trt.triton.layout import VERSION
from qvl_trt.triton.pbconfig import read_config, set_parameters, write_config

pytestmark = pytest.mark.skipif(find_tritonserver() is None,
                                reason="needs a tritonserver: pip install 'qvl-trt[serve]'")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: pip install "
                                 "'qvl-trt[serve]'")

MAX_NUM_TOKENS = 8  # one chunk: two blocks of 4


def _png() -> bytes:
    # 128 x 96 pixels: 12 visual tokens, so the image runs across a chunk boundary.
    pixels = np.random.default_rng(5).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


QUESTION = GenerateRequest("Describe the picture, its colours and its shapes, in a few words.",
                           (_png(),), max_tokens=6)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_build):
    from qvl_trt.serve.server import ServerOptions, TritonServer, free_ports
    from qvl_trt.triton.options import Flavor
    from qvl_trt.triton.repository import BuildInput, RepoOptions, write_repo

    root = tmp_path_factory.mktemp("chunked")
    repo = write_repo([BuildInput(tiny_build)], root / "repo",
                      RepoOptions(flavor=Flavor.REFERENCE, preprocessing_instances=1,
                                  vision_cache_mib=16))
    path = repo.path / c.TENSORRT_LLM / VERSION / BUILD_CONFIG_NAME
    build = json.loads(path.read_text())
    build["max_num_tokens"] = MAX_NUM_TOKENS
    build["plugin_config"]["tokens_per_block"] = 4
    path.write_text(json.dumps(build))
    # Explicit model control, so that a model can be reloaded.
    with TritonServer(ServerOptions(repo.path, free_ports(), explicit_models=repo.models),
                      log_file=root / "server.log", startup_timeout_s=180) as running:
        yield running


def test_a_prompt_above_max_num_tokens_is_chunked_or_refused_as_the_executor_does(
        server, triton_server) -> None:
    with GenerateClient(f"grpc://{server.grpc_url}") as client:
        chunked = client.generate(QUESTION)
    with GenerateClient(f"grpc://{triton_server.grpc_url}") as client:
        one_pass = client.generate(QUESTION)  # max_num_tokens 1024: one pass
    assert chunked.prompt_tokens == one_pass.prompt_tokens > 3 * MAX_NUM_TOKENS
    assert chunked.text == one_pass.text and chunked.completion_tokens == 6

    # The operator turns chunked context off and reloads the model.
    folder = server.opts.repo / c.TENSORRT_LLM
    config = read_config(folder)
    set_parameters(config, {"enable_chunked_context": False})
    write_config(config, folder)
    with grpcclient.InferenceServerClient(server.grpc_url) as admin:
        admin.load_model(c.TENSORRT_LLM)
    refused = (f"Prompt length ({chunked.prompt_tokens}) exceeds maximum input length "
               f"({MAX_NUM_TOKENS})")
    with GenerateClient(f"grpc://{server.grpc_url}") as client, \
            pytest.raises(RequestError, match=re.escape(refused)):
        client.generate(QUESTION)
