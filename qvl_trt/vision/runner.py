"""Run a built vision engine on one image, from torch CUDA tensors.

Loading refuses, with the rebuild command, an engine built by another TensorRT edition or
version or for another compute capability; for TensorRT-RTX it also asks the runtime itself
(`Runtime.get_engine_validity`, which reads only the engine header).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..deps import require
from ..errors import BuildError, InputError
from ..manifest import VISION_ENGINE_NAME
from ..mm.vision_index import PIXEL_VALUES, VisionIndex
from ..profiles import TrtEdition
from .engine import (
    EDITION_NAMES,
    make_trt_logger,
    read_engine_config,
    trt_module,
)

log = logging.getLogger(__name__)

REBUILD = "rebuild it here with `qvl-trt build --only vision --force` (same --out)"


def check_engine_runtime(config: dict[str, Any], trt) -> None:
    """Raise BuildError unless an engine with this config.json was built by the edition and
    version of the TensorRT module `trt` (engines load only in the version that built them)."""
    edition = TrtEdition(config["edition"])
    here = TrtEdition.TENSORRT_RTX if "rtx" in trt.__name__ else TrtEdition.TENSORRT
    if edition is not here:
        raise BuildError(f"the vision engine was built with {edition.value}, this runtime is "
                         f"{here.value} {trt.__version__}; {REBUILD} --trt-edition "
                         f"{here.value}")
    if config["trt_version"] != trt.__version__:
        raise BuildError(f"the vision engine was built with {edition.value} "
                         f"{config['trt_version']}, this runtime is {trt.__version__}; "
                         f"{REBUILD}")


def check_engine_gpu(config: dict[str, Any], compute_capability: str) -> None:
    """Raise BuildError unless the engine was built for a GPU of `compute_capability`."""
    if compute_capability not in config["compute_capabilities"]:
        raise BuildError(f"the vision engine was built for compute capability "
                         f"{'/'.join(config['compute_capabilities'])}, this GPU is "
                         f"{compute_capability}; rebuild it with a --gpu profile for this card")


def check_rtx_validity(trt, header: bytes) -> None:
    """Ask TensorRT-RTX whether an engine (its header is enough) is valid on this system."""
    logger = make_trt_logger(trt)
    validity, diagnostics = trt.Runtime(logger).get_engine_validity(header)
    if validity == trt.EngineValidity.VALID:
        return
    reasons = [name.lower().replace("_", " ") for name, flag
               in trt.EngineInvalidityDiagnostics.__members__.items()
               if int(diagnostics) & int(flag)]
    detail = ", ".join(reasons) or "; ".join(logger.errors) or "no reason given"
    if validity == trt.EngineValidity.SUBOPTIMAL:
        log.warning("TensorRT-RTX: the vision engine may run slowly here (%s)", detail)
        return
    raise BuildError(f"TensorRT-RTX {trt.__version__} reports the vision engine invalid on "
                     f"this system ({detail}); {REBUILD}")


class VisionEngine:
    """A vision engine loaded on the current CUDA device; call it once per image."""

    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        self.config = read_engine_config(folder)
        trt = trt_module(TrtEdition(self.config["edition"]))
        check_engine_runtime(self.config, trt)
        torch = require("torch", extra="export", why="run the vision engine")
        if not torch.cuda.is_available():
            raise BuildError("running the vision engine needs a CUDA GPU, and CUDA sees none")
        major, minor = torch.cuda.get_device_capability()
        check_engine_gpu(self.config, f"{major}.{minor}")
        blob = (folder / VISION_ENGINE_NAME).read_bytes()
        if TrtEdition(self.config["edition"]) is TrtEdition.TENSORRT_RTX:
            check_rtx_validity(trt, blob)
        self._torch = torch
        self._logger = make_trt_logger(trt)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise BuildError(f"{EDITION_NAMES[TrtEdition(self.config['edition'])]} could not "
                             f"load {folder / VISION_ENGINE_NAME} "
                             f"({' | '.join(self._logger.errors) or 'no error logged'}); "
                             f"{REBUILD}")
        self.context = self.engine.create_execution_context()
        # Our own stream, not the caller's current one (the legacy default stream unless
        # they set one, which serialises with all other work on the device).
        self._stream = torch.cuda.Stream()
        self.patches = self.config["patches"]
        self._dtypes = {t["name"]: getattr(torch, t["dtype"])
                        for t in self.config["inputs"] + self.config["outputs"]}

    def __call__(self, pixel_values, index: VisionIndex) -> dict[str, Any]:
        """Encode one image: `pixel_values` [N, patch_dim] uint8 (torch tensor, any device) and
        its host index tensors -> {output name: CUDA tensor [N/4, out_hidden]}."""
        torch = self._torch
        n = int(pixel_values.shape[0])
        if pixel_values.dtype != self._dtypes[PIXEL_VALUES]:
            # A cast would truncate normalised floats to garbage without a word.
            raise InputError(f"pixel_values is {pixel_values.dtype}, the vision engine takes "
                             f"the resized image's {self._dtypes[PIXEL_VALUES]} values; send "
                             "qvl_trt.mm.pixels.image_patches' rows")
        if n != index.num_patches:
            raise InputError(f"pixel_values has {n} rows, the index tensors {index.num_patches}")
        if not self.patches["min"] <= n <= self.patches["max"]:
            raise InputError(
                f"image of {n} patches is outside the engine's range {self.patches['min']}.."
                f"{self.patches['max']}; resize it within the profile's pixel limits")
        device = torch.device("cuda", torch.cuda.current_device())
        inputs = {PIXEL_VALUES: pixel_values,
                  **{k: torch.from_numpy(np.ascontiguousarray(v))
                     for k, v in index.as_dict().items()}}
        # IExecutionContext.set_input_shape returns False for a shape outside the profile
        # (TensorRT 10 Python API); execution would then fail with a less useful message.
        for spec in self.config["inputs"]:
            name = spec["name"]
            shape = tuple(inputs[name].shape)
            if not self.context.set_input_shape(name, shape):
                low, _, high = self.engine.get_tensor_profile_shape(name, 0)
                raise InputError(
                    f"vision engine input {name} of shape {list(shape)} is outside the "
                    f"engine's range {list(low)}..{list(high)}; resize the image within the "
                    "profile's pixel limits")
        caller = torch.cuda.current_stream(device)
        outputs = {}
        for spec in self.config["outputs"]:
            name = spec["name"]
            shape = tuple(self.context.get_tensor_shape(name))
            # Allocated on the caller's stream, which uses them after we return.
            outputs[name] = torch.empty(shape, dtype=self._dtypes[name], device=device)
            self.context.set_tensor_address(name, outputs[name].data_ptr())
        # pixel_values may still be being written on the caller's stream, and the outputs'
        # memory may have been in use there: start after that work.
        self._stream.wait_stream(caller)
        bound = {}
        with torch.cuda.stream(self._stream):
            # The copies run on our stream, so they precede the engine's kernels in order.
            for spec in self.config["inputs"]:
                name = spec["name"]
                bound[name] = inputs[name].to(device=device,
                                              dtype=self._dtypes[name]).contiguous()
                self.context.set_tensor_address(name, bound[name].data_ptr())
            if not self.context.execute_async_v3(self._stream.cuda_stream):
                raise BuildError(f"TensorRT failed to run the vision engine on {n} patches: "
                                 f"{' | '.join(self._logger.errors[-3:]) or 'no error logged'}")
        # enqueueV3 only enqueues: `bound` must live, and the outputs are complete for the
        # caller's stream, once our stream has finished.
        self._stream.synchronize()
        return outputs
