"""Would each python model of a repository load in this Python environment? A real
tritonserver in explicit model-control mode loads them one at a time through its repository
API, with this interpreter as the python backend's (its stub finds `python3` on PATH, see
server.env_prepends), and reports each failure in one line: the stub's own exception. This is
what `qvl-trt doctor --repo` runs, in the serving image or in an environment made to match it.
"""

from __future__ import annotations

import json
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..triton.pbconfig import CONFIG_FILE, parse_config
from .server import ServerOptions, TritonServer, free_ports, new_admin_key

# Loading runs each model's initialize (the preprocessing kernels compile, the tokenizer
# loads); a model that takes longer is reported, not waited for.
LOAD_TIMEOUT_S = 300


@dataclass(frozen=True)
class ModelLoad:
    model: str
    ok: bool
    detail: str  # "loaded", or the one-line reason it did not


def python_models(repo: Path) -> tuple[str, ...]:
    """The repository's python-backend models (ensembles and tensorrtllm models are not
    loaded by this check: they hold no Python of ours)."""
    names = []
    for path in sorted(Path(repo).glob(f"*/{CONFIG_FILE}")):
        if parse_config(path.read_text(), str(path)).backend == "python":
            names.append(path.parent.name)
    return tuple(names)


def check_model_loads(repo: Path, models: tuple[str, ...] | None = None) -> tuple[ModelLoad, ...]:
    """Load each of `models` (default: every python model) in a tritonserver of its own
    repository, and unload it again."""
    models = python_models(repo) if models is None else models
    with tempfile.TemporaryDirectory(prefix="qvl-load-check-") as tmp:
        opts = ServerOptions(Path(repo).resolve(), free_ports(), explicit_models=(),
                             admin_key=new_admin_key())
        with TritonServer(opts, log_file=Path(tmp) / "server.log") as server:
            return tuple(_load(f"http://{server.http_url}", server.admin_headers, name)
                         for name in models)


def _load(base: str, headers: dict[str, str], model: str) -> ModelLoad:
    url = f"{base}/v2/repository/models/{model}"
    try:
        _post(f"{url}/load", headers, LOAD_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        return ModelLoad(model, False, load_error_line(_error_text(exc)))
    except (urllib.error.URLError, TimeoutError) as exc:
        return ModelLoad(model, False, f"no answer from tritonserver while loading ({exc})")
    try:
        _post(f"{url}/unload", headers, 60)
    except (urllib.error.URLError, TimeoutError):
        pass  # the server is stopped right after the check anyway
    return ModelLoad(model, True, "loaded")


def _post(url: str, headers: dict[str, str], timeout: float) -> None:
    request = urllib.request.Request(url, data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=timeout):
        pass


def _error_text(exc: urllib.error.HTTPError) -> str:
    body = exc.read().decode(errors="replace")
    try:
        return str(json.loads(body).get("error", body))
    except ValueError:
        return body


def load_error_line(text: str) -> str:
    """The line that says why: the python backend reports a failed initialize as
    "failed to load 'M' version 1: Internal: ModuleNotFoundError: No module named 'numba'"
    followed by the stub's traceback ("At:" and frames)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else "failed to load (no reason given)"
    for marker in ("Internal: ", "Invalid argument: ", "Unavailable: "):
        if marker in head:
            return head.split(marker, 1)[1]
    return head
