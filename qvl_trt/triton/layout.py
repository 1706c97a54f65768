"""The model repository's layout, which `qvl-trt repo` writes and `serve`, `validate` and the
served models read: the version folder of each model and the files in it, and `build.json`
(`BuildInfo`), what the repository holds. An engine folder holds the files as the build wrote
them (manifest.py names them). Nothing here imports the writer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..dtypes import WeightOnly
from ..errors import ConfigError
from ..profiles import GpuProfile, TrtEdition
from ..typed_config import load_dataclass
from . import contract as c
from .options import Flavor

VERSION = "1"  # each model's one version folder
MODEL_PY = "model.py"  # a python model's code (from triton_repo/)
RUNTIME_ZIP = "qvl_trt_runtime.zip"  # beside it: the qvl_trt package it imports
CHECKPOINT_DIR = "checkpoint"  # in a version folder: configs, tokenizer, weights
ENGINE_DIR = "engine"  # in a version folder: the vision or LLM engine
BUILD_INFO = "build.json"  # in the ensemble's version folder: what the repository holds
TOKENIZER_JSON = "tokenizer.json"  # the checkpoint's, in the postprocessing and BLS folders
# xgrammar's view of the tokenizer, in tensorrt_llm's version folder (guided decoding; the
# name upstream's examples/generate_xgrammar_tokenizer_info.py writes).
TOKENIZER_INFO_NAME = "xgrammar_tokenizer_info.json"
# The reference flavor's vision tower weights, in vision_encoder's CHECKPOINT_DIR.
VISION_WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class BuildInfo:
    """`<ensemble>/1/build.json`: what the repository holds, which validate and serve check
    it against."""

    qvl_trt: str
    flavor: Flavor
    # The build it was written from, by content; not its folder, whose absolute path would
    # make build.json differ between two builds of the same inputs.
    cache_key: str
    models: c.ModelNames
    profile: GpuProfile
    llm_dtype: str
    vision_dtype: str
    tp_size: int
    trt_edition: TrtEdition
    kv_cache_tokens: int  # the KV budget planned for this build beside the others
    prompt_table_rows: int
    shm_bytes: int  # shared memory its largest requests need in flight
    weights: WeightOnly = WeightOnly.NONE  # the LLM's linear weights (`build --weights`)

    @classmethod
    def read(cls, path: Path) -> BuildInfo:
        try:
            data = json.loads(Path(path).read_text())
            if isinstance(data, dict):
                data.pop("build", None)  # the build folder's path, which older versions wrote
            return load_dataclass(cls, data, str(path))
        except json.JSONDecodeError as exc:
            problem = f"{path} is not JSON ({exc})"
        except ConfigError as exc:
            problem = str(exc)
        raise ConfigError(f"{problem}; regenerate the repository with `qvl-trt repo`")
