"""Run in the container-equivalent environment by tests/test_deploy_image.py: what a
repository's python models and the gateway import only at a first request of a kind, outside
a server, on the code each runs. `preprocessing`: the model's own qvl_trt_runtime.zip on a
text, an image, a video file (PyAV) and a json_schema and a regex guide (xgrammar); the
postprocessing and BLS models import nothing after their load. `gateway` (qvl_trt from
PYTHONPATH, as in the image): its app, Triton channel, compact grammar (xgrammar) and answer
check (jsonschema). Prints one line per failed request and exits 1.

usage: python container_first_requests.py preprocessing REPO VIDEO_FILE
       python container_first_requests.py gateway
"""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path


def preprocessing_requests(repo: Path, video: bytes) -> list[str]:
    model = repo / "preprocessing" / "1"
    sys.path.insert(0, str(model / "qvl_trt_runtime.zip"))  # as model.py does
    import numpy as np
    from google.protobuf import json_format, text_format
    from PIL import Image
    from tritonclient.grpc import model_config_pb2

    from qvl_trt.triton import contract
    from qvl_trt.triton.runtime.preprocessing import Preprocessor

    config = text_format.Parse((model.parent / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    params = contract.PreprocessingParameters.from_parameters(
        contract.config_parameters(json_format.MessageToDict(
            config, preserving_proto_field_name=True)), "preprocessing")
    step = Preprocessor(model / "checkpoint", params)
    png = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 90)).save(png, "PNG")
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    requests = {
        "text": {},
        "image": {"image_bytes": np.array([png.getvalue()], dtype=object)},
        "video": {"video_bytes": np.array([video], dtype=object)},
        "json_schema guide": {"guided_decoding_guide_type": b"json_schema",
                              "guided_decoding_guide": schema.encode()},
        "regex guide": {"guided_decoding_guide_type": b"regex",
                        "guided_decoding_guide": b"[a-z]{1,4}"},
    }
    failures = []
    for kind, inputs in requests.items():
        try:
            step({"text_input": b"Describe it.", "max_tokens": np.int32(4), **inputs})
        except Exception as exc:  # each kind reports on its own line
            failures.append(f"preprocessing, {kind} request: {type(exc).__name__}: {exc}")
    return failures


def gateway_requests() -> list[str]:
    from qvl_trt.gateway.app import Gateway
    from qvl_trt.gateway.guides import check_answer, compact_grammar
    from qvl_trt.gateway.openai_api import Structure
    from qvl_trt.gateway.options import GatewayOptions
    from qvl_trt.gateway.upstream import Upstream

    async def channel() -> None:
        await Upstream("127.0.0.1:1").client.close()  # made, not connected

    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    steps = {
        "app": lambda: Gateway(GatewayOptions("127.0.0.1:1")).app(),
        "Triton channel": lambda: asyncio.run(channel()),
        "guided request": lambda: compact_grammar(schema),
        "guided answer": lambda: check_answer(Structure(schema=schema, schema_param="s"),
                                              json.dumps({"a": 1}), "stop"),
    }
    failures = []
    for what, run in steps.items():
        try:
            run()
        except Exception as exc:
            failures.append(f"gateway, {what}: {type(exc).__name__}: {exc}")
    return failures


if __name__ == "__main__":
    if sys.argv[1:2] == ["preprocessing"]:
        lines = preprocessing_requests(Path(sys.argv[2]), Path(sys.argv[3]).read_bytes())
    else:
        lines = gateway_requests()
    print("\n".join(" ".join(line.split()) for line in lines))
    sys.exit(1 if lines else 0)
