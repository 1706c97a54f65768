"""A benchmark fixture: times the moves of a request's tensors between the python models of a
benchmark's own repository (scripts/bench_hops.py). Never part of a repository `qvl-trt repo`
writes: the benchmark installs it into its own copy with `install_hop_timer`.

Each model's model.py is moved aside and replaced by a subclass of its TritonPythonModel whose
execute() appends one JSON line per call to a log beside it: when execute was entered and
when it returned (CLOCK_MONOTONIC, one clock for every process of the machine) and the bytes
of each input tensor of each request (and of each output tensor it returned). The python
backend has copied a request's inputs into the model's process before execute is entered, and
copies a non-decoupled model's outputs out after it returns, so the time from one model's
return to the next model's entry is what moving the tensors between them costs (the
shared-memory copies, Triton's scheduling).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..triton.layout import MODEL_PY

INNER = "timed_model.py"  # the model's own model.py, moved aside
LOG = "hop_times.jsonl"

WRAPPER = '''"""A benchmark fixture (qvl_trt.testing.hop_timer): the model of timed_model.py, each
execute() call logged to hop_times.jsonl (entered/returned CLOCK_MONOTONIC ns, input bytes)."""

import importlib.util
import json
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("qvl_timed_model", HERE / "timed_model.py")
_inner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_inner)


def _nbytes(array):
    if array.dtype == object:  # BYTES: the payload, not the object pointers
        return sum(len(v) for v in array.reshape(-1))
    return int(array.nbytes)


class TritonPythonModel(_inner.TritonPythonModel):
    def execute(self, requests):
        entered = time.monotonic_ns()
        inputs = [{t.name(): _nbytes(t.as_numpy()) for t in r.inputs()} for r in requests]
        responses = super().execute(requests)
        returned = time.monotonic_ns()
        outputs = [{t.name(): _nbytes(t.as_numpy()) for t in r.output_tensors()}
                   for r in responses or ()]
        with open(HERE / "hop_times.jsonl", "a") as log:
            log.write(json.dumps({"entered": entered, "returned": returned, "inputs": inputs,
                                  "outputs": outputs}) + "\\n")
        return responses
'''


@dataclass(frozen=True)
class ExecuteCall:
    """One logged execute() call."""

    entered_ns: int
    returned_ns: int
    inputs: tuple[dict[str, int], ...]  # per request: input name -> bytes
    # per response (non-decoupled models; decoupled ones send theirs later): name -> bytes
    outputs: tuple[dict[str, int], ...]


def install_hop_timer(version_folder: Path) -> None:
    """Wrap the python model in `version_folder` (of a benchmark's own repository)."""
    folder = Path(version_folder)
    if (folder / INNER).exists():
        raise FileExistsError(f"{folder} already has the hop timer")
    (folder / MODEL_PY).rename(folder / INNER)
    (folder / MODEL_PY).write_text(WRAPPER)
    shutil.rmtree(folder / "__pycache__", ignore_errors=True)


def read_calls(version_folder: Path, skip: int = 0) -> list[ExecuteCall]:
    """The logged calls of one model, oldest first, without the first `skip`."""
    log = Path(version_folder) / LOG
    lines = log.read_text().splitlines() if log.exists() else []
    calls = []
    for line in lines[skip:]:
        data = json.loads(line)
        calls.append(ExecuteCall(data["entered"], data["returned"], tuple(data["inputs"]),
                                 tuple(data["outputs"])))
    return calls
