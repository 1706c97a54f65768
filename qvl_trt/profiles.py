"""GPU profiles: `build_configs/<name>.toml` (or a user's file) -> validated GpuProfile."""

from __future__ import annotations

import enum
import json
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from .checkpoint import PIXELS_PER_IMAGE_TOKEN, PIXELS_PER_VIDEO_TOKEN, TEMPORAL_PATCH_SIZE
from .errors import ConfigError
from .resources import data_dir
from .typed_config import load_dataclass

MIB = 2**20

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib



def sm_digits(compute_capability: str) -> str:
    """"8.9" -> "89": the compute capability as NVIDIA's SM names spell it (sm_89, SM89)."""
    major, minor = compute_capability.split(".")
    return f"{int(major)}{int(minor)}"


class TrtEdition(str, enum.Enum):
    """The TensorRT edition that builds and runs the vision engine on a card."""

    TENSORRT = "tensorrt"  # data-center cards; engines are built on the target GPU
    TENSORRT_RTX = "tensorrt_rtx"  # GeForce/RTX cards; builds ahead of time without a GPU


@dataclass(frozen=True)
class GpuFacts:
    description: str
    compute_capability: str
    # Total memory as the driver reports it (nvidia-smi memory.total), not the marketing
    # figure: an "24 GB" A10G exposes 23028 MiB, and the planner starts from this total.
    memory_mib: int
    memory_bandwidth_gbs: float
    fp16_tensor_tflops: float
    trt_edition: TrtEdition
    # The nvidia.com/gpu.product node label GPU feature discovery gives the card (`qvl-trt
    # deploy` selects nodes by it); "" in a profile that names none.
    product: str = ""


@dataclass(frozen=True)
class BuildLimits:
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    kv_cache_free_gpu_mem_fraction: float
    vision_min_pixels: int
    vision_max_pixels: int
    max_images_per_request: int
    # Visual tokens (images and videos) one request may carry in all; sizes the engine's
    # prompt table (1 + K rows per token and batch slot), which the runtime re-copies for
    # every request every step.
    max_visual_tokens_per_request: int
    # Video: 0 videos per request turns video input off. Frames sampled from one video
    # (transformers' max_frames); the vision engine takes one temporal group (two frames) per
    # call, so a frame's pixels are capped like an image's; one video's merged tokens (its
    # pixel budget: frames x height x width <= video_max_tokens x 2048, capping the
    # checkpoint's own).
    max_videos_per_request: int
    video_max_frames: int
    video_max_pixels_per_frame: int
    video_max_tokens: int

    @property
    def max_image_tokens(self) -> int:
        """Merged visual tokens of the largest image the profile admits."""
        return self.vision_max_pixels // PIXELS_PER_IMAGE_TOKEN

    @property
    def video_max_pixels(self) -> int:
        """One video's pixel budget (frames x height x width) at the profile's token cap."""
        return self.video_max_tokens * PIXELS_PER_VIDEO_TOKEN

    @property
    def max_request_visual_tokens(self) -> int:
        """What the largest images and videos a request may carry make together."""
        return (self.max_image_tokens * self.max_images_per_request
                + self.video_max_tokens * self.max_videos_per_request)


@dataclass(frozen=True)
class VisionBuild:
    builder_optimization_level: int
    workspace_gib: float


@dataclass(frozen=True)
class GpuProfile:
    name: str
    source: str
    gpu: GpuFacts
    limits: BuildLimits
    vision_build: VisionBuild

    @property
    def memory_bytes(self) -> int:
        return self.gpu.memory_mib * MIB

    @property
    def sm(self) -> int:
        """Compute capability as an integer, e.g. 89 for "8.9"."""
        return int(sm_digits(self.gpu.compute_capability))


@dataclass(frozen=True)
class _ProfileFile:
    gpu: GpuFacts
    limits: BuildLimits
    vision_build: VisionBuild


def profile_names() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.stem for p in data_dir("build_configs").glob("*.toml"))


def _is_path(gpu: str) -> bool:
    return gpu.endswith(".toml") or "/" in gpu or "\\" in gpu


def resolve_profile_path(gpu: str) -> Path:
    """`gpu` is a shipped profile name (`4090d`) or a path to a TOML file."""
    if _is_path(gpu):
        path = Path(gpu)
        if not path.is_file():
            raise ConfigError(f"GPU profile file {gpu} does not exist")
        return path
    path = data_dir("build_configs") / f"{gpu.lower()}.toml"
    if not path.is_file():
        raise ConfigError(
            f"unknown GPU profile {gpu!r}; shipped profiles: {', '.join(profile_names())} "
            "(or pass a path to your own .toml)"
        )
    return path


def profile_argument(gpu: str) -> str:
    """`--gpu` as a build records it: a profile name as given, a path made absolute so that
    a resumed build (run from anywhere) finds it."""
    return str(Path(gpu).resolve()) if _is_path(gpu) else gpu


def load_profile(gpu: str) -> GpuProfile:
    """Load and validate a GPU profile by name or path."""
    path = resolve_profile_path(gpu)
    where = f"profile {path.name}"
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not valid TOML ({exc})") from None
    parsed = load_dataclass(_ProfileFile, data, where)
    profile = GpuProfile(
        name=path.stem,
        source=str(path),
        gpu=parsed.gpu,
        limits=parsed.limits,
        vision_build=parsed.vision_build,
    )
    _check(profile, where)
    return profile


def profile_toml(profile: GpuProfile, comment: str) -> str:
    """The profile as a file load_profile reads back equal (name and source aside), headed by
    `comment` (# lines)."""
    lines = [f"# {line}" if line else "#" for line in comment.splitlines()]
    for table in fields(_ProfileFile):
        lines += ["", f"[{table.name}]"]
        section = getattr(profile, table.name)
        lines += [f"{f.name} = {_toml_value(getattr(section, f.name))}" for f in fields(section)]
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    return repr(value)


def gpu_product_label(device_name: str) -> str:
    """The nvidia.com/gpu.product value GPU feature discovery makes of an NVML device name
    ("NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3"): characters other than letters,
    digits, - _ . and blanks dropped, the words joined by '-' (NVIDIA/k8s-device-plugin
    internal/lm/resource.go, sanitise). A label value passes unchanged."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", device_name).split())


# A Kubernetes label value: at most 63 characters, alphanumeric at both ends, - _ . inside
# (k8s.io/apimachinery pkg/util/validation/validation.go, IsValidLabelValue).
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def check_gpu_product(value: str, where: str) -> str:
    """`value` if it can be the nvidia.com/gpu.product label, else a ConfigError."""
    if not _LABEL_VALUE.fullmatch(value):
        raise ConfigError(
            f"{where} {value!r} is not a node label value: GPU feature discovery writes the "
            "NVML device name with blanks as '-' (e.g. NVIDIA-H100-80GB-HBM3); "
            "`kubectl get nodes -L nvidia.com/gpu.product` shows your nodes' values")
    return value


def _check(p: GpuProfile, where: str) -> None:
    """Reject values that no build could use, naming the key and the fix."""
    if p.gpu.product:
        check_gpu_product(p.gpu.product, f"{where}: gpu.product")
    if not re.fullmatch(r"\d+\.\d", p.gpu.compute_capability):
        raise ConfigError(
            f'{where}: gpu.compute_capability must look like "8.9", '
            f"got {p.gpu.compute_capability!r}"
        )
    lim = p.limits
    positive = {
        "gpu.memory_mib": p.gpu.memory_mib,
        "gpu.memory_bandwidth_gbs": p.gpu.memory_bandwidth_gbs,
        "gpu.fp16_tensor_tflops": p.gpu.fp16_tensor_tflops,
        "limits.max_batch_size": lim.max_batch_size,
        "limits.max_input_len": lim.max_input_len,
        "limits.max_seq_len": lim.max_seq_len,
        "limits.max_num_tokens": lim.max_num_tokens,
        "limits.tokens_per_block": lim.tokens_per_block,
        "limits.vision_min_pixels": lim.vision_min_pixels,
        "limits.vision_max_pixels": lim.vision_max_pixels,
        "limits.max_images_per_request": lim.max_images_per_request,
        "limits.max_visual_tokens_per_request": lim.max_visual_tokens_per_request,
        "vision_build.workspace_gib": p.vision_build.workspace_gib,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{where}: {key} must be positive, got {value}")
    if not 0 < lim.kv_cache_free_gpu_mem_fraction < 1:
        raise ConfigError(
            f"{where}: limits.kv_cache_free_gpu_mem_fraction must be between 0 and 1, "
            f"got {lim.kv_cache_free_gpu_mem_fraction}"
        )
    if lim.tokens_per_block & (lim.tokens_per_block - 1):
        raise ConfigError(
            f"{where}: limits.tokens_per_block must be a power of two, got {lim.tokens_per_block}"
        )
    if lim.max_seq_len <= lim.max_input_len:
        raise ConfigError(
            f"{where}: limits.max_seq_len ({lim.max_seq_len}) must exceed limits.max_input_len "
            f"({lim.max_input_len}) to leave room for output tokens"
        )
    if lim.vision_min_pixels > lim.vision_max_pixels:
        raise ConfigError(
            f"{where}: limits.vision_min_pixels ({lim.vision_min_pixels}) exceeds "
            f"limits.vision_max_pixels ({lim.vision_max_pixels})"
        )
    if lim.vision_max_pixels < PIXELS_PER_IMAGE_TOKEN * 4:
        raise ConfigError(
            f"{where}: limits.vision_max_pixels ({lim.vision_max_pixels}) is below one 64x64 "
            "image; raise it"
        )
    cap, image = lim.max_visual_tokens_per_request, lim.max_image_tokens
    if cap < image:
        raise ConfigError(
            f"{where}: limits.max_visual_tokens_per_request ({cap}) is below the {image} tokens "
            f"of one image at limits.vision_max_pixels ({lim.vision_max_pixels}); raise it to "
            f"at least {image} or lower limits.vision_max_pixels"
        )
    _check_video(lim, where)
    if cap > lim.max_request_visual_tokens:
        raise ConfigError(
            f"{where}: limits.max_visual_tokens_per_request ({cap}) exceeds what "
            f"{lim.max_images_per_request} images at limits.vision_max_pixels and "
            f"{lim.max_videos_per_request} videos at limits.video_max_tokens can make "
            f"({lim.max_request_visual_tokens}), which only enlarges the prompt table; "
            "lower it to that, or raise limits.max_images_per_request or "
            "limits.max_videos_per_request"
        )
    if cap >= lim.max_input_len:
        raise ConfigError(
            f"{where}: limits.max_visual_tokens_per_request ({cap}) leaves no room for text in "
            f"limits.max_input_len ({lim.max_input_len}); lower it or raise limits.max_input_len"
        )
    if not 0 <= p.vision_build.builder_optimization_level <= 5:
        raise ConfigError(
            f"{where}: vision_build.builder_optimization_level must be 0..5, "
            f"got {p.vision_build.builder_optimization_level}"
        )


def _check_video(lim: BuildLimits, where: str) -> None:
    """The video limits of a profile that admits videos."""
    if lim.max_videos_per_request < 0:
        raise ConfigError(f"{where}: limits.max_videos_per_request must be 0 (no video) or "
                          f"more, got {lim.max_videos_per_request}")
    if lim.max_videos_per_request == 0:
        return
    if lim.video_max_frames < TEMPORAL_PATCH_SIZE:
        raise ConfigError(f"{where}: limits.video_max_frames ({lim.video_max_frames}) is below "
                          f"one temporal patch of {TEMPORAL_PATCH_SIZE} frames; raise it")
    if not 0 < lim.video_max_pixels_per_frame <= lim.vision_max_pixels:
        raise ConfigError(
            f"{where}: limits.video_max_pixels_per_frame ({lim.video_max_pixels_per_frame}) "
            f"must be positive and at most limits.vision_max_pixels "
            f"({lim.vision_max_pixels}): the vision engine takes one pair of frames per call "
            "and is built for images up to that size"
        )
    if not 0 < lim.video_max_tokens <= lim.max_visual_tokens_per_request:
        raise ConfigError(
            f"{where}: limits.video_max_tokens ({lim.video_max_tokens}) must be positive and "
            f"at most limits.max_visual_tokens_per_request "
            f"({lim.max_visual_tokens_per_request}), which sizes the prompt table; lower it "
            "or raise the other"
        )
