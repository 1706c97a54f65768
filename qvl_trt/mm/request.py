"""One request -> every tensor the engines need. The single entry point shared by the Triton
preprocessing model, the reference pipeline and `qvl-trt preprocess`.

Light on purpose (numpy, PIL and the transformers tokenizer; no torch): the Triton
preprocessing model runs it per request.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..atomic import staged_file
from ..chat_messages import (
    CheckedMessages,
    ImageBudget,
    VideoBudget,
    VideoInput,
    media_counts,
    read_messages,
    user_message,
)
from ..checkpoint import Checkpoint, VisionDims, open_checkpoint
from ..errors import ConfigError, EngineLimitError, FieldError, InputError, LimitError
from ..profiles import GpuProfile, load_profile
from . import video as vid
from .chat import PromptBuilder
from .geometry import LOW_DETAIL_MAX_PIXELS
from .image_input import DEFAULT_MAX_DECODED_PIXELS, load_rgb, open_image, read_image_files
from .kernels import pixel_pool
from .pixels import ImagePatches, PixelConfig, image_patch_count, image_patches
from .prompt_table import fake_token_ids, prompt_table_extra_ids, rows_per_visual_token, scope_ids
from .rope import MropeTable, rope_index
from .video import VideoConfig, VideoLimits, VideoPatches
from .video_input import load_clip
from .vision_index import (
    PIXEL_VALUES,
    POS_INTERP_INDICES,
    POS_INTERP_WEIGHTS,
    ROPE_POSITION_IDS,
    vision_index_tensors,
)

ImageInput = bytes | bytearray | memoryview | Image.Image


@dataclass(frozen=True)
class RequestBounds:
    """Caps on a request's size and structure, checked before its images are fetched or decoded
    and before its text is tokenized, so an oversized request costs the server next to nothing.
    The engine's own limits (images, prompt tokens, max_tokens) are RequestLimits' other fields.
    The names are the preprocessing model's parameters (the repository writes the defaults)."""

    # Bytes of the inputs as sent (messages, text_input, image_bytes, stop): above several
    # full-size images, below Docker's default 64 MB /dev/shm the python backend moves them in.
    max_request_bytes: int = 32 * 2**20
    max_messages: int = 256  # a long chat; max_input_len refuses longer prompts anyway
    max_content_parts: int = 512  # over all messages: texts and images
    # One text (text_input, a message's text): ~4 bytes a token makes it 256k tokens, above
    # every profile's max_input_len, and it tokenizes in well under a second.
    max_text_bytes: int = 2**20
    # TensorRT-LLM matches every stop word at every step and its stop_words_list tensor grows
    # with their tokens; OpenAI's API allows 4 stop strings.
    max_stop_words: int = 16
    max_stop_bytes: int = 256  # one stop string
    max_stop_tokens: int = 256  # all stop strings together, tokenized

    def check(self, field: str, size: int, limit_name: str, fix: str) -> None:
        """Refuse `size` above the bound `limit_name` (a LimitError: the gateway answers 413),
        in one line naming both and the fix."""
        limit = getattr(self, limit_name)
        if size > limit:
            raise LimitError(f"{field} is {size}, above the limit of {limit} (the "
                             f"preprocessing model's {limit_name} parameter); {fix}")


@dataclass(frozen=True)
class RequestLimits:
    """What a deployment admits per request. `min_pixels` replaces the checkpoint's minimum,
    `max_pixels` caps its maximum; None keeps the checkpoint's value."""

    max_images: int
    max_input_len: int
    max_seq_len: int  # the engine's max_position_embeddings (the profile's max_seq_len)
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_decoded_pixels: int = DEFAULT_MAX_DECODED_PIXELS
    # Visual tokens of all images and videos together: the engine's prompt table holds (1+K)
    # rows per token for this many (limits.max_visual_tokens_per_request); None: no cap.
    max_visual_tokens: int | None = None
    bounds: RequestBounds = RequestBounds()
    video: VideoLimits = VideoLimits()

    def check_image_count(self, count: int) -> None:
        if count > self.max_images:
            raise EngineLimitError(f"request has {count} images, the engine allows "
                                   f"{self.max_images}; send fewer images")

    def check_messages(self, messages: Sequence[Any]) -> None:
        """The bounds on chat messages: how many, their content parts, each text's bytes, and
        the number of image and video parts."""
        b = self.bounds
        b.check("the number of messages", len(messages), "max_messages", "send fewer turns")
        parts = 0
        for message in messages:
            content = message.get("content") if isinstance(message, Mapping) else None
            items = content if isinstance(content, list) else [content]
            parts += len(items)
            for item in items:
                text = item.get("text") if isinstance(item, Mapping) else item
                if isinstance(text, str):
                    b.check("the UTF-8 size of a message text", len(text.encode()),
                            "max_text_bytes", "shorten the text")
        b.check("the number of content parts of all messages", parts, "max_content_parts",
                "send fewer parts")
        images, videos = media_counts(messages)
        self.check_image_count(images)
        self.video.check_video_count(videos)

    def checked_messages(self, messages: Sequence[Any],
                         mm_processor_kwargs: Mapping[str, Any] | None = None) \
            -> CheckedMessages:
        """Messages within the bounds (`check_messages`), then checked and read with their
        budgets (chat_messages.read_messages): what a request's later steps take."""
        self.check_messages(messages)
        return read_messages(messages, mm_processor_kwargs)

    @classmethod
    def from_fields(cls, params: Any) -> RequestLimits:
        """From an object that has RequestBounds' and VideoLimits' fields as attributes of
        the same names, and this class's own (those it lacks keep their defaults): the
        preprocessing model's parameters (triton.contract.PreprocessingParameters)."""
        def read(kind: type) -> Any:
            return kind(**{f.name: getattr(params, f.name) for f in fields(kind)})

        own = {f.name: getattr(params, f.name) for f in fields(cls)
               if f.name not in ("bounds", "video") and hasattr(params, f.name)}
        return cls(**own, bounds=read(RequestBounds), video=read(VideoLimits))

    @classmethod
    def from_profile(cls, profile: GpuProfile) -> RequestLimits:
        lim = profile.limits
        video = VideoLimits(max_videos=lim.max_videos_per_request,
                            max_video_frames=lim.video_max_frames,
                            max_video_frame_pixels=lim.video_max_pixels_per_frame,
                            max_video_tokens=lim.video_max_tokens)
        return cls(max_images=lim.max_images_per_request, max_input_len=lim.max_input_len,
                   max_seq_len=lim.max_seq_len, min_pixels=lim.vision_min_pixels,
                   max_pixels=lim.vision_max_pixels,
                   max_visual_tokens=lim.max_visual_tokens_per_request, video=video)

    @classmethod
    def of_checkpoint(cls, checkpoint: Checkpoint) -> RequestLimits:
        """No deployment caps: the model's own context length, any number of images and
        videos, each within the checkpoint's sampling limits."""
        positions = checkpoint.text.max_position_embeddings
        return cls(max_images=2**31 - 1, max_input_len=positions, max_seq_len=positions,
                   video=VideoLimits(max_videos=2**31 - 1, max_video_seconds=math.inf))


@dataclass(frozen=True)
class PreparedRequest:
    """Every tensor of one request; `tensors()` names them as docs/build.md documents."""

    text: str  # the rendered prompt, one pad per image and per video
    # The vision items in prompt order: each image, and each temporal group of each video
    # (grid (1, h, w) each: the tower runs and caches item by item). Each item's pixel_values
    # is a view of `pixel_values`, so no step concatenates them.
    images: tuple[ImagePatches, ...]
    pixel_values: np.ndarray  # [patches of all items, patch_dim] uint8, prompt order
    image_token_counts: tuple[int, ...]  # merged visual tokens per item
    input_ids: np.ndarray  # [seq] int32, visual tokens = the image or video pad id
    engine_input_ids: np.ndarray  # [seq] int32, visual token i = vocab_size + (1+K)i
    position_ids: np.ndarray  # [3, seq] int64
    mrope_position_delta: int
    mrope: MropeTable  # builds mrope_rotary_cos_sin from position_ids
    prompt_table_extra_ids: np.ndarray  # [seq] uint64
    prompt_vocab_size: int  # prompt-table rows: (1+K) * visual tokens
    vision: VisionDims  # the tower the images are for
    videos: tuple[VideoPatches, ...] = ()  # each video (its groups are among `images`)
    cache_scope: str = ""  # whose cached images and KV blocks it may use ("": shared)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def media_tokens(self) -> tuple[int, int]:
        """(image tokens, video tokens) of the prompt: what its usage reports."""
        merge = self.vision.spatial_merge_size ** 2
        video = sum(clip.num_patches for clip in self.videos) // merge
        return sum(self.image_token_counts) - video, video

    @property
    def mrope_rotary_cos_sin(self) -> np.ndarray:
        """[max_seq_len * head_dim] float32, built on each call (the Triton preprocessing step
        sends position_ids instead)."""
        return self.mrope(self.position_ids)

    @property
    def image_grid_thw(self) -> np.ndarray:
        return np.array([p.grid_thw for p in self.images], np.int64).reshape(-1, 3)

    @property
    def image_hashes(self) -> np.ndarray:
        """Each item's content hash within the request's cache scope: the vision cache's key,
        and its visual tokens' prompt_table_extra_ids."""
        return scope_ids(np.array([p.hash64 for p in self.images], np.uint64),
                         self.cache_scope)

    def tensors(self) -> dict[str, np.ndarray]:
        """All tensors by their stable names (images in prompt order), with the vision tower's
        index inputs that the Triton vision_encoder computes itself (for `qvl-trt
        preprocess`'s file)."""
        def cat(parts: list[np.ndarray], empty: tuple[int, ...], dtype) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(empty, dtype)

        idx = [vision_index_tensors(p.grid_thw, self.vision) for p in self.images]
        return {
            "input_ids": self.input_ids,
            "engine_input_ids": self.engine_input_ids,
            "position_ids": self.position_ids,
            "mrope_position_deltas": np.array([self.mrope_position_delta], np.int64),
            "mrope_rotary_cos_sin": self.mrope_rotary_cos_sin,
            "prompt_table_extra_ids": self.prompt_table_extra_ids,
            "prompt_vocab_size": np.array([self.prompt_vocab_size], np.int32),
            PIXEL_VALUES: self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "image_hashes": self.image_hashes,
            POS_INTERP_INDICES: cat([i.pos_interp_indices for i in idx], (0, 4), np.int32),
            POS_INTERP_WEIGHTS: cat([i.pos_interp_weights for i in idx], (0, 4), np.float32),
            ROPE_POSITION_IDS: cat([i.rope_position_ids for i in idx], (0, 2), np.int32),
        }

    def save_npz(self, path: Path) -> Path:
        """Write `tensors()` (uncompressed) through a temporary file and a rename."""
        path = Path(path)
        with staged_file(path) as f:
            np.savez(f, **self.tensors())
        return path


class RequestPreprocessor:
    """Loads the tokenizer and the image and video processor settings once; `prepare` runs per
    request."""

    def __init__(self, checkpoint: Checkpoint, prompts: PromptBuilder, pixels: PixelConfig,
                 limits: RequestLimits, videos: VideoConfig) -> None:
        self.checkpoint = checkpoint
        self.prompts = prompts
        self.pixels = pixels
        self.limits = limits
        self.videos = videos

    @classmethod
    def from_checkpoint(cls, path: str | Path, limits: RequestLimits | None = None) \
            -> RequestPreprocessor:
        checkpoint = open_checkpoint(path, validate=False)
        limits = limits or RequestLimits.of_checkpoint(checkpoint)
        pixels = PixelConfig.of_checkpoint(checkpoint)
        min_pixels = pixels.min_pixels if limits.min_pixels is None else limits.min_pixels
        max_pixels = min(pixels.max_pixels, limits.max_pixels or pixels.max_pixels)
        if min_pixels > max_pixels:
            raise ConfigError(f"the deployment's minimum of {min_pixels} pixels per image exceeds "
                              f"the maximum of {max_pixels} (checkpoint and profile caps); lower "
                              "limits.vision_min_pixels")
        if limits.max_input_len > limits.max_seq_len:
            raise ConfigError(f"max_input_len {limits.max_input_len} exceeds the "
                              f"{limits.max_seq_len} positions of the MRoPE table")
        vision = checkpoint.vision
        if (pixels.patch_size, pixels.merge_size, pixels.temporal_patch_size) != (
                vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size):
            raise ConfigError(f"{checkpoint.path}: preprocessor_config.json patch/merge/temporal "
                              "sizes disagree with config.json's vision_config")
        videos = VideoConfig.of_checkpoint(checkpoint)
        videos.check_matches(pixels)
        clip = videos.pixels
        videos = replace(videos, pixels=clip.with_bounds(
            clip.min_pixels, limits.video.clip_pixels(clip.max_pixels)))
        prompts = PromptBuilder.from_checkpoint(checkpoint.path, checkpoint.token_ids)
        return cls(checkpoint, prompts, pixels.with_bounds(min_pixels, max_pixels), limits,
                   videos)

    @property
    def video_frame_cap(self) -> int:
        """Pixels of one resized video frame at most: the deployment's, else its per-image
        maximum (which the vision engine's optimisation profile covers)."""
        return self.limits.video.max_video_frame_pixels or self.pixels.max_pixels

    def image_bounds(self, budget: ImageBudget) -> PixelConfig:
        """The image processor at one image's budget, within the deployment's bounds
        (`self.pixels`): detail low caps it at LOW_DETAIL_MAX_PIXELS, high and auto keep the
        deployment's bounds (its default is its whole budget), explicit min_pixels and
        max_pixels replace them. A bound outside the deployment's is refused, naming the
        limit, never clamped: above it an EngineLimitError (a larger build may take it)."""
        low, high = self.pixels.min_pixels, self.pixels.max_pixels
        if budget.detail == "low":
            return self.pixels.with_bounds(low, max(low, min(LOW_DETAIL_MAX_PIXELS, high)))
        for key in ("min_pixels", "max_pixels"):
            value, field = getattr(budget, key), f"{budget.where}.{key}"
            if value is not None and value > high:
                raise EngineLimitError(f"{field} = {value} is above the deployment's maximum "
                                       f"of {high} pixels per image (limits.vision_max_pixels); "
                                       f"send at most {high}")
            if value is not None and value < low:
                raise FieldError(f"{field} = {value} is below the deployment's minimum of {low} "
                                 "pixels per image (limits.vision_min_pixels); send at least "
                                 f"{low}", field)
        # min_pixels <= max_pixels where both are given: chat_messages.image_budget's rule.
        bounds = (budget.min_pixels or low, budget.max_pixels or high)
        return self.pixels if bounds == (low, high) else self.pixels.with_bounds(*bounds)

    def video_bounds(self, budget: VideoBudget) -> tuple[VideoConfig, int]:
        """(the video processor, pixels of one resized frame at most) at one video's budget:
        max_frames and max_pixels at most the deployment's, refused above them (fps travels
        with the video itself)."""
        frames = min(self.videos.max_frames, self.limits.video.max_video_frames)
        cap, where = self.video_frame_cap, budget.where
        if budget.max_frames is not None and budget.max_frames > frames:
            raise EngineLimitError(f"{where}.max_frames = {budget.max_frames} is above the "
                                   f"deployment's limit of {frames} frames per video "
                                   f"(limits.video_max_frames); send at most {frames}")
        if budget.max_frames is not None and budget.max_frames < self.videos.pixels.\
                temporal_patch_size:
            raise FieldError(f"{where}.max_frames = {budget.max_frames}: a video needs at least "
                             f"{self.videos.pixels.temporal_patch_size} frames",
                             f"{where}.max_frames")
        if budget.max_pixels is not None and budget.max_pixels > cap:
            raise EngineLimitError(f"{where}.max_pixels = {budget.max_pixels} is above the "
                                   f"deployment's limit of {cap} pixels per video frame "
                                   f"(limits.video_max_pixels_per_frame); send at most {cap}")
        config = self.videos if budget.max_frames is None else \
            replace(self.videos, max_frames=budget.max_frames)
        return config, budget.max_pixels or cap

    def prepare(self, *, messages: CheckedMessages | Sequence[Mapping[str, Any]],
                images: Sequence[ImageInput] = (),
                videos: Sequence[VideoInput] = (),
                tools: Sequence[Mapping[str, Any]] | None = None,
                cache_scope: str = "") -> PreparedRequest:
        """Images and videos are the messages' image and video parts, each in order of
        appearance; `tools`: the functions the chat template lists (OpenAI's);
        `cache_scope`: see PreparedRequest. Messages already checked
        (RequestLimits.checked_messages) are not checked again."""
        lim, ckpt = self.limits, self.checkpoint
        if not isinstance(messages, CheckedMessages):
            messages = lim.checked_messages(messages)
        lim.check_image_count(len(images))
        lim.video.check_video_count(len(videos))
        text, image_parts, video_parts = self.prompts.render(messages, tools)
        if image_parts != len(images):
            raise InputError(f"messages hold {image_parts} image parts but {len(images)} images "
                             "were sent; send one image per image part")
        if video_parts != len(videos):
            raise InputError(f"messages hold {video_parts} video parts but {len(videos)} videos "
                             "were sent; send one video per video part")
        self.prompts.check_fits(text, lim.max_input_len)
        configs = [self.image_bounds(b) for b in messages.image_budgets]
        video_bounds = [self.video_bounds(b) for b in messages.video_budgets]
        order = self.prompts.placeholders(text, len(images), len(videos))
        media = f"{len(images)} images" + (f" and {len(videos)} videos" if videos else "")
        fewer = "images or videos" if videos else "images"
        image_tokens = self._header_token_counts(images, configs)
        self._check_visual_tokens(image_tokens, media, fewer)
        with self._decoding(images) as decoding:
            decoded_videos = self._decode_videos(videos, video_bounds, image_tokens, media,
                                                 fewer)
            t = self.videos.pixels.temporal_patch_size
            ids = self.prompts.encode(text, len(images), [  # while the images decode
                [vid.timestamp_text(s) for s in vid.group_timestamps(times, t)]
                for _, times, *_ in decoded_videos])
            pixel_values, pictures, clips, items = self._vision_items(order, decoding, configs,
                                                                      decoded_videos)
        merge = ckpt.vision.spatial_merge_size ** 2
        counts = tuple(item.num_patches // merge for item in items)
        self._check_visual_tokens(counts, media, fewer)
        input_ids = self.prompts.expand(
            ids, [picture.num_patches // merge for picture in pictures],
            [[group.num_patches // merge for group in clip.groups] for clip in clips])
        if input_ids.size > lim.max_input_len:
            raise EngineLimitError(
                f"prompt has {input_ids.size} tokens ({sum(counts)} of them for {media}), the "
                f"engine allows {lim.max_input_len}: shorten the text or send fewer or smaller "
                f"{fewer}")
        image_id, deepstack = ckpt.token_ids.image, ckpt.vision.deepstack_count
        # Each temporal group of a video is a vision item of grid (1, h, w), placed and
        # embedded as an image is (HF get_rope_index splits video grids into such rows): past
        # the tokenizer, video pads are image pads.
        visual_ids = np.where(input_ids == ckpt.token_ids.video, image_id, input_ids)
        rope = rope_index(visual_ids, [item.grid_thw for item in items],
                          image_token_id=image_id,
                          spatial_merge_size=ckpt.vision.spatial_merge_size)
        return PreparedRequest(
            text=text, images=items, pixel_values=pixel_values, image_token_counts=counts,
            input_ids=input_ids,
            engine_input_ids=fake_token_ids(visual_ids, image_token_id=image_id,
                                            vocab_size=ckpt.text.vocab_size,
                                            deepstack_count=deepstack),
            position_ids=rope.position_ids, mrope_position_delta=rope.delta,
            mrope=MropeTable.of(ckpt.text, lim.max_seq_len),
            prompt_table_extra_ids=prompt_table_extra_ids(
                visual_ids, image_token_id=image_id,
                image_hashes=[item.hash64 for item in items], image_token_counts=counts,
                scope=cache_scope),
            prompt_vocab_size=rows_per_visual_token(deepstack) * sum(counts),
            vision=ckpt.vision, videos=clips, cache_scope=cache_scope,
        )


    def _header_token_counts(self, images: Sequence[ImageInput],
                             configs: Sequence[PixelConfig]) -> list[int]:
        """Each image's visual tokens at its budget (`configs`) from its header's size (before
        any pixel is decoded; EXIF rotation swaps the sides, not the count); refuses what its
        header already refuses (format, decode bound, aspect ratio, below one merge block)."""
        counts, merge = [], self.checkpoint.vision.spatial_merge_size ** 2
        for number, (image, config) in enumerate(zip(images, configs, strict=True), 1):
            with _numbered("image", number):
                if isinstance(image, Image.Image):
                    counts.append(image_patch_count(image, config) // merge)
                    continue
                with open_image(image, max_decoded_pixels=self.limits.max_decoded_pixels) \
                        as header:
                    counts.append(image_patch_count(header, config) // merge)
        return counts

    def _check_visual_tokens(self, counts: Sequence[int], media: str, fewer: str) -> None:
        cap = self.limits.max_visual_tokens
        if cap is not None and sum(counts) > cap:
            raise EngineLimitError(
                f"request has {sum(counts)} visual tokens in {media}, the engine's prompt "
                f"table holds {cap} per request: send fewer or smaller {fewer}, or rebuild "
                "with a larger limits.max_visual_tokens_per_request")

    @contextmanager
    def _decoding(self, images: Sequence[ImageInput]) -> Iterator[list[Future[Image.Image]]]:
        """Start decoding the images side by side on the pixel pool (Pillow releases the GIL
        while it decodes). A request refused meanwhile (a bad image or video) cancels the
        decodes not started and waits for the others: none runs on behind it."""
        decoding = [pixel_pool().submit(load_rgb, image,
                                        max_decoded_pixels=self.limits.max_decoded_pixels)
                    for image in images]
        try:
            yield decoding
        except BaseException:
            for pending in decoding:
                pending.cancel()
            wait(decoding)
            raise

    def _decode_videos(self, videos: Sequence[VideoInput],
                       bounds: Sequence[tuple[VideoConfig, int]], image_tokens: Sequence[int],
                       media: str, fewer: str) \
            -> list[tuple[tuple[Image.Image, ...], tuple[float, ...], int, tuple[int, int]]]:
        """Each video's frames, frame times, patch count and resized (height, width), decoded
        here (their resize uses the pixel pool itself) at its budget (`bounds`: its processor
        and frame cap, `video_bounds`). A file's frame size and visual tokens, with the
        images' and the videos' before it, are checked from its header before its frames
        decode, and its frames are resized as they decode."""
        decoded, config = [], self.videos.pixels
        known, sizes = list(image_tokens), []
        merge = self.checkpoint.vision.spatial_merge_size ** 2

        def before_decoding(count: int, width: int, height: int) -> tuple[int, int]:
            # `cap`: the frame cap of the video the loop below is loading
            sizes.append(vid.clip_frame_size(count, width, height, config, cap))
            known.append(vid.clip_patch_count(count, *sizes[-1], config) // merge)
            self._check_visual_tokens(known, media, fewer)
            return sizes[-1]  # the frames come back resized: video_patches is told the size

        for number, (video, (sampling, cap)) in enumerate(zip(videos, bounds, strict=True), 1):
            with _numbered("video", number):
                sizes.clear()
                frames, times = load_clip(video, sampling, self.limits.video,
                                          max_decoded_pixels=self.limits.max_decoded_pixels,
                                          before_decoding=before_decoding)
                size = sizes[0] if sizes else vid.resized_video_size(frames, config, cap)
                decoded.append((frames, times, vid.clip_patch_count(len(frames), *size, config),
                                size))
        return decoded

    def _vision_items(self, order: Sequence[bool], decoding: Sequence[Future[Image.Image]],
                      configs: Sequence[PixelConfig],
                      decoded_videos: Sequence[tuple[Sequence[Image.Image], Sequence[float],
                                                     int, tuple[int, int]]]) -> tuple[
            np.ndarray, tuple[ImagePatches, ...], tuple[VideoPatches, ...],
            tuple[ImagePatches, ...]]:
        """Wait for the images to decode, then cut every image (at its budget, `configs`) and
        video into its slice of one uint8 buffer, in prompt order (`order`: is the next
        placeholder a video's?). Returns the buffer, the images, the videos and the vision
        items (images and temporal groups) in prompt order."""
        decoded_images = []
        for number, (pending, config) in enumerate(zip(decoding, configs, strict=True), 1):
            with _numbered("image", number):
                rgb = pending.result()
                decoded_images.append((rgb, image_patch_count(rgb, config), config))
        total = sum(count for _, count, _ in decoded_images) + \
            sum(count for _, _, count, _ in decoded_videos)
        buffer = np.empty((total, self.pixels.patch_dim), np.uint8)
        pending_images = enumerate(decoded_images, 1)
        pending_videos = enumerate(decoded_videos, 1)
        pictures, clips, items, start = [], [], [], 0
        for is_video in order:
            if not is_video:
                number, (rgb, count, config) = next(pending_images)
                with _numbered("image", number):
                    picture = image_patches(rgb, config, out=buffer[start:start + count])
                pictures.append(picture)
                items.append(picture)
            else:
                number, (frames, times, count, size) = next(pending_videos)
                with _numbered("video", number):
                    clip = vid.video_patches(frames, times, self.videos.pixels,
                                             self.video_frame_cap,
                                             out=buffer[start:start + count], size=size)
                clips.append(clip)
                items.extend(clip.groups)
            start += count
        return buffer, tuple(pictures), tuple(clips), tuple(items)


@contextmanager
def _numbered(kind: str, number: int) -> Iterator[None]:
    """Prefix an InputError about one image or video with its number."""
    try:
        yield
    except InputError as exc:
        raise InputError(f"{kind} {number}: {exc}") from None


def prepare_files(model: str | Path, images: Sequence[Path], prompt: str, *,
                  gpu: str | None = None) -> PreparedRequest:
    """`qvl-trt preprocess`: one user turn (the images, then `prompt`) with a profile's limits
    (`gpu`) or the checkpoint's own."""
    data = read_image_files(images)
    limits = RequestLimits.from_profile(load_profile(gpu)) if gpu else None
    preprocessor = RequestPreprocessor.from_checkpoint(model, limits)
    return preprocessor.prepare(messages=user_message(prompt, len(data)), images=data)
