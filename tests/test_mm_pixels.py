"""Image intake and pixel pipeline: equal to the Hugging Face Qwen3-VL image processor (PIL
backend, configured from the tiny checkpoint's preprocessor_config.json), and every bad input
refused with its message."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from qvl_trt.errors import InputError
from qvl_trt.mm import pixels
from qvl_trt.mm.image_input import load_rgb
from qvl_trt.mm.pixels import ImagePatches, PixelConfig, image_patches


def _content(width: int, height: int, seed: int) -> np.ndarray:
    """Gradients plus noise: smooth areas and edges both reach the bicubic filter."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / max(width, 1), y / max(height, 1), ((x + y) % 97) / 97], -1) * 230
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def _encoded(image: Image.Image, fmt: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def _exif_rotated_jpeg(orientation: int) -> bytes:
    image = Image.fromarray(_content(640, 480, 7))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _encoded(image, "JPEG", quality=92, exif=exif)


def _cases() -> list[tuple[str, object]]:
    """(id, input) pairs: PIL images of many sizes and modes, and encoded files."""
    sizes = [(32, 32), (33, 2000), (2000, 33), (4000, 3000), (1920, 1080), (1080, 1920),
             (640, 480), (511, 513), (17, 17), (1, 1), (5, 900), (64, 64), (255, 257),
             (300, 200), (1000, 10), (123, 457), (1023, 767), (1280, 720), (96, 4000),
             (2048, 2048), (399, 401)]
    cases: list[tuple[str, object]] = [
        (f"rgb-{w}x{h}", Image.fromarray(_content(w, h, i))) for i, (w, h) in enumerate(sizes)]
    rgb = Image.fromarray(_content(320, 240, 99))
    alpha = Image.fromarray(_content(300, 200, 5)[..., 0])
    rgba = Image.fromarray(_content(300, 200, 3)).convert("RGBA")
    rgba.putalpha(alpha)
    palette_transparent = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    palette_transparent.info["transparency"] = 3
    cases += [
        ("grayscale-L", rgb.convert("L")),
        ("rgba", rgba),
        ("la", rgba.convert("LA")),
        ("palette", rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)),
        ("palette-transparent", palette_transparent),
        ("bilevel-1", rgb.convert("1")),
        ("cmyk", rgb.convert("CMYK")),
        ("jpeg-bytes", _encoded(rgb, "JPEG", quality=90)),
        ("png-rgba-bytes", _encoded(rgba, "PNG")),
        ("webp-bytes", _encoded(rgb, "WEBP", lossless=True)),
        ("gif-bytes", _encoded(palette_transparent, "GIF")),
        ("bmp-bytes", _encoded(rgb, "BMP")),
        ("cmyk-jpeg-bytes", _encoded(rgb.convert("CMYK"), "JPEG", quality=90)),
        ("exif-rotated-jpeg-6", _exif_rotated_jpeg(6)),
        ("exif-rotated-jpeg-3", _exif_rotated_jpeg(3)),
    ]
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def hf_processor(tiny_ckpt):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoImageProcessor.from_pretrained(str(tiny_ckpt), backend="pil")


@pytest.fixture(scope="module")
def pixel_config(tiny_ckpt) -> PixelConfig:
    from qvl_trt.checkpoint import open_checkpoint

    return PixelConfig.from_preprocessor_config(open_checkpoint(tiny_ckpt).preprocessor_config,
                                                "tiny preprocessor_config.json")


def _hf_view(case: object) -> Image.Image:
    """What HF's processor is handed: files go through load_image's EXIF transpose."""
    from PIL import ImageOps

    if isinstance(case, bytes):
        return ImageOps.exif_transpose(Image.open(io.BytesIO(case)))
    return case


def test_case_count():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[name for name, _ in CASES])
def test_pixels_equal_hf(case, hf_processor, pixel_config):
    ours = image_patches(load_rgb(case), pixel_config)
    hf = hf_processor(_hf_view(case), return_tensors="np")
    assert list(ours.grid_thw) == hf["image_grid_thw"][0].tolist()
    _assert_equal_hf(ours.pixel_values, hf["pixel_values"], pixel_config)


def _assert_equal_hf(ours: np.ndarray, hf: np.ndarray, config: PixelConfig) -> None:
    """Our uint8 rows are HF's float rows to the last bit: the table the vision graph looks
    them up in maps them onto HF's values exactly (the table is one-to-one per channel, so
    the 8-bit values are equal too), and an image fills both temporal frames alike."""
    assert ours.dtype == np.uint8
    assert ours.shape == hf.shape
    assert np.array_equal(config.normalise(ours), hf)
    frames = ours.reshape(len(ours), config.channels, config.temporal_patch_size, -1)
    assert (frames == frames[:, :, :1]).all()


@pytest.mark.parametrize("size, rows", [((2400, 1800), 8112), ((3840, 2160), 7920),
                                        ((1000, 4000), 7920)])
def test_pixels_equal_hf_with_a_profile_cap(size, rows, hf_processor, pixel_config):
    """A deployment's pixel cap (4090 profile: 2 Mpx) resizes like HF told the same bounds
    (3840x2160: both sides shrink, horizontal pass first; 1000x4000: vertical first)."""
    capped = pixel_config.with_bounds(65536, 2_097_152)
    image = Image.fromarray(_content(*size, 11))
    ours = image_patches(image, capped)
    hf = hf_processor(image, size={"shortest_edge": 65536, "longest_edge": 2_097_152},
                      return_tensors="np")
    assert ours.pixel_values.shape == (rows, 1536)
    _assert_equal_hf(ours.pixel_values, hf["pixel_values"], capped)


def test_channel_order_matters_to_the_hf_check(hf_processor, pixel_config):
    """Break it on purpose: rows whose channels are swapped, or one pixel off by one, fail
    the exact check."""
    image = Image.fromarray(_content(320, 240, 4))
    ours = image_patches(image, pixel_config).pixel_values
    hf = hf_processor(image, return_tensors="np")["pixel_values"]
    swapped = ours.reshape(len(ours), 3, -1)[:, ::-1].reshape(ours.shape)
    off_by_one = ours.copy()
    off_by_one[7, 100] ^= 1
    for broken in (swapped, off_by_one):
        with pytest.raises(AssertionError):
            _assert_equal_hf(broken, hf, pixel_config)


def test_patches_write_into_a_given_buffer(pixel_config):
    image = Image.fromarray(_content(320, 240, 6))
    alone = image_patches(image, pixel_config).pixel_values
    buffer = np.zeros((len(alone) + 3, pixel_config.patch_dim), np.uint8)
    into = image_patches(image, pixel_config, out=buffer[3:])
    assert np.shares_memory(into.pixel_values, buffer)
    assert np.array_equal(buffer[3:], alone) and not buffer[:3].any()
    with pytest.raises(ValueError, match="needs contiguous uint8"):
        image_patches(image, pixel_config, out=buffer)
    with pytest.raises(ValueError, match="needs contiguous uint8"):
        image_patches(image, pixel_config, out=np.zeros_like(alone, order="F"))


@pytest.mark.parametrize("size", [(1920, 1080), (1080, 1920), (700, 500), (640, 480)],
                         ids=["height-only", "width-only", "both", "no-resize"])
@pytest.mark.parametrize("strips", [1, 3, 7])
def test_strips_equal_hf_whatever_their_number(size, strips, hf_processor, pixel_config,
                                               monkeypatch):
    """The resize and the patch cutting run in strips of output rows, one per core: any
    number of strips gives HF's pixels, whichever side changes."""
    monkeypatch.setattr(pixels, "_THREADS", strips)
    image = Image.fromarray(_content(*size, 11))
    ours = image_patches(image, pixel_config)
    _assert_equal_hf(ours.pixel_values, hf_processor(image, return_tensors="np")["pixel_values"],
                     pixel_config)


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    """Noise: the two pass orders of a resize then differ in almost every pixel."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8))


def _two_passes(image: Image.Image, w: int, h: int, vertical_first: bool) -> Image.Image:
    bicubic = Image.Resampling.BICUBIC
    first = (image.width, h) if vertical_first else (w, image.height)
    return image.resize(first, resample=bicubic).resize((w, h), resample=bicubic)


def _resize_cases() -> list[tuple[int, int, int, int]]:
    """(W, H, w, h): shrinks and growths of either side or both, odd sizes, ties of the
    rule, and 3840x2160 at the 4090 profile's cap."""
    rng = np.random.default_rng(5)
    cases = [(3840, 2160, 1920, 1056), (600, 3000, 416, 2208), (511, 513, 512, 512),
             (1010, 1000, 1024, 992), (64, 64, 36, 8), (64, 64, 40, 8), (33, 2000, 64, 2016),
             (2000, 33, 2016, 64), (17, 17, 256, 256), (123, 457, 160, 512)]
    while len(cases) < 120:
        W, H, w, h = (int(v) for v in rng.integers(5, 700, 4))
        if W != w and H != h:
            cases.append((W, H, w, h))
    return cases


def test_pass_order_rule_equals_one_resize():
    """Where both sides change, Pillow makes two 8-bit passes in an order of its choosing;
    the rule `_pass_order` found for the installed Pillow gives one whole resize's pixels
    everywhere (a Pillow with another rule fails here instead of drifting), and the other
    order does not: the check can fail."""
    rule = pixels._pass_order(Image.Resampling.BICUBIC)
    assert rule is not None, "the installed Pillow follows none of the known pass orders"
    picked = {True: 0, False: 0}
    for i, (W, H, w, h) in enumerate(_resize_cases()):
        image = _noise(W, H, i)
        whole = np.asarray(image.resize((w, h), resample=Image.Resampling.BICUBIC))
        vertical_first = rule(W, H, w, h)
        picked[vertical_first] += 1
        assert np.array_equal(np.asarray(_two_passes(image, w, h, vertical_first)), whole), \
            (W, H, w, h, vertical_first)
        other = np.asarray(_two_passes(image, w, h, not vertical_first))
        assert not np.array_equal(other, whole), (W, H, w, h)
    if rule is pixels._horizontal_first:  # Pillow 12 and older: one order only
        assert picked[True] == 0, picked
    else:
        assert min(picked.values()) >= 10, picked  # both orders exercised


def test_probe_sizes_tell_the_known_rules_apart():
    """Each known rule but one fails the probe at some size, so the probe picks one rule."""
    image = _noise(64, 64)
    for rule in pixels._PASS_ORDERS:
        others = [r for r in pixels._PASS_ORDERS if r is not rule]
        for other in others:
            assert any(rule(64, 64, w, h) != other(64, 64, w, h)
                       for w, h in pixels._PROBE_SIZES)
    for w, h in pixels._PROBE_SIZES:
        assert not np.array_equal(np.asarray(_two_passes(image, w, h, True)),
                                  np.asarray(_two_passes(image, w, h, False)))


@pytest.mark.parametrize("size, cap", [((3840, 2160), 2_097_152), ((600, 3000), 1_000_000),
                                       ((1010, 1000), 16_777_216), ((511, 513), 16_777_216),
                                       ((2000, 33), 16_777_216), ((1000, 10), 16_777_216)],
                         ids=["4k-horizontal-first", "tall-vertical-first", "vertical-first",
                              "odd-vertical-first", "wide-grow", "wide-grow-both"])
@pytest.mark.parametrize("strips", [1, 2, 3, 7])
def test_both_passes_in_strips_equal_one_resize(size, cap, strips, pixel_config, monkeypatch):
    """Both passes run in strips (each strip's first pass over the source rows it needs):
    the patches equal those of the image resized in one call, whatever the number of strips."""
    monkeypatch.setattr(pixels, "_THREADS", strips)
    config = pixel_config.with_bounds(65536, cap)
    image = Image.fromarray(_content(*size, 3))
    h, w = pixels.resized_size(*size, config)
    assert w != size[0] and h != size[1]
    whole = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    assert np.array_equal(image_patches(image, config).pixel_values,
                          image_patches(whole, config).pixel_values)


def test_an_unknown_pass_order_resizes_in_one_call(hf_processor, pixel_config, monkeypatch):
    """Break it on purpose: a wrong rule for the first pass changes the pixels; with only a
    wrong rule known, the probe finds none and the resize runs as one call, equal to HF."""
    image = Image.fromarray(_content(511, 513, 8))
    hf = hf_processor(image, return_tensors="np")["pixel_values"]
    pixels._pass_order.cache_clear()
    right = pixels._pass_order(Image.Resampling.BICUBIC)
    wrong = next(rule for rule in pixels._PASS_ORDERS if rule is not right)
    try:
        monkeypatch.setattr(pixels, "_pass_order", lambda resample: wrong)
        with pytest.raises(AssertionError):
            _assert_equal_hf(image_patches(image, pixel_config).pixel_values, hf, pixel_config)
        monkeypatch.undo()
        monkeypatch.setattr(pixels, "_PASS_ORDERS", (wrong,))
        pixels._pass_order.cache_clear()
        assert pixels._pass_order(Image.Resampling.BICUBIC) is None
        _assert_equal_hf(image_patches(image, pixel_config).pixel_values, hf, pixel_config)
    finally:
        monkeypatch.undo()
        pixels._pass_order.cache_clear()


def _kernel_resize(image: Image.Image, w: int, h: int, resample: int) -> np.ndarray:
    """The kernels' resize of a whole image (pixels._pillow_resize), channel planes
    restacked."""
    plan = pixels._pillow_resize(image.width, image.height, w, h, resample)
    assert plan is not None
    planes = np.asarray(image).transpose(2, 0, 1)
    return np.stack([plan.rows(np.ascontiguousarray(p), 0, h) for p in planes], axis=-1)


def test_kernel_resize_equals_pillow():
    """The compiled passes with Pillow's taps give Image.resize's pixels exactly: both sides
    in either order (the 120 cases above), one side shrinking or growing, bicubic and
    bilinear."""
    one_side = [(1920, 1080, 1920, 1088), (1080, 1920, 1088, 1920), (640, 480, 640, 448),
                (700, 33, 70, 33), (33, 700, 33, 70), (5, 900, 5, 4000), (900, 5, 4000, 5)]
    for i, (W, H, w, h) in enumerate(one_side + _resize_cases()):
        image = _noise(W, H, i)
        for resample in (Image.Resampling.BICUBIC, Image.Resampling.BILINEAR):
            assert np.array_equal(_kernel_resize(image, w, h, resample),
                                  np.asarray(image.resize((w, h), resample=resample))), \
                (W, H, w, h, resample)


def test_kernel_resize_check_can_fail(monkeypatch):
    """Break it on purpose: a tap's weight one step of 2^-22 off, or Pillow 12's pass order
    where the installed Pillow starts with the vertical pass, change pixels."""
    image = _noise(700, 500, 1)
    pillow = np.asarray(image.resize((650, 1300), resample=Image.Resampling.BICUBIC))
    taps = pixels.pillow_taps(500, 1300, Image.Resampling.BICUBIC)
    nudged = taps.weights.copy()
    nudged[:, 1] += 1 << 12
    monkeypatch.setattr(pixels, "pillow_taps", lambda *args: taps._replace(weights=nudged))
    assert not np.array_equal(_kernel_resize(image, 650, 1300, Image.Resampling.BICUBIC),
                              pillow)
    monkeypatch.undo()
    W, H, w, h = 300, 600, 280, 200  # the height shrinks by far more than the width
    if pixels._pass_order(Image.Resampling.BICUBIC)(W, H, w, h):
        monkeypatch.setattr(pixels, "_pass_order", lambda resample: pixels._horizontal_first)
        assert not np.array_equal(_kernel_resize(_noise(W, H), w, h, Image.Resampling.BICUBIC),
                                  np.asarray(_noise(W, H).resize((w, h))))


def test_other_filters_resize_in_pillow(pixel_config):
    """A filter without taps here (Lanczos) is resized by Pillow in one call: same patches
    as cutting Pillow's own resize."""
    config = pixel_config.with_bounds(65536, 300_000)
    lanczos = PixelConfig(**{**{f: getattr(config, f) for f in (
        "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
        "image_mean", "image_std")}, "resample": int(Image.Resampling.LANCZOS)})
    image = Image.fromarray(_content(700, 500, 2))
    h, w = pixels.resized_size(700, 500, lanczos)
    whole = image.resize((w, h), resample=Image.Resampling.LANCZOS)
    assert np.array_equal(image_patches(image, lanczos).pixel_values,
                          image_patches(whole, lanczos).pixel_values)


@pytest.mark.parametrize("patch", [16, 14], ids=["8-byte-words", "bytes"])
def test_patch_rows_follow_the_layout(patch, pixel_config):
    """The patch writer against the layout spelled out in numpy (merge blocks in raster
    order, rows (channel, frame, y, x)), for a patch row of whole 8-byte words (Qwen3-VL's 16)
    and one that is not (Qwen2-VL's 14)."""
    config = PixelConfig(**{**{f: getattr(pixel_config, f) for f in (
        "max_pixels", "temporal_patch_size", "merge_size", "image_mean", "image_std")},
        "patch_size": patch, "min_pixels": 0})  # no resize: the image is whole blocks
    m, f, t = config.merge_size, config.factor, config.temporal_patch_size
    image = Image.fromarray(_content(5 * f, 3 * f, 9))
    pixels_ = np.asarray(image).reshape(3, m, patch, 5, m, patch, 3)
    layout = pixels_.transpose(0, 3, 1, 4, 6, 2, 5)[:, :, :, :, :, None]
    expected = np.broadcast_to(layout, layout.shape[:5] + (t,) + layout.shape[6:])
    assert np.array_equal(image_patches(image, config).pixel_values,
                          expected.reshape(-1, config.patch_dim))


def test_warm_up_compiles_what_requests_use(pixel_config):
    """After warm_up, images of every kind of resize, and video frames, compile nothing more
    (a request never waits for the compiler)."""
    from qvl_trt.mm import kernels, video

    compiled = (kernels.vertical_pass, kernels.horizontal_pass, kernels.write_patches,
                kernels._copy_patch_rows)
    pixels.warm_up(pixel_config)
    before = [len(k.signatures) for k in compiled]
    for size in [(640, 480), (1920, 1080), (1080, 1920), (700, 500), (300, 2000), (2000, 300)]:
        image_patches(Image.fromarray(_content(*size, 4)), pixel_config)
    for size in [(640, 360), (320, 320)]:
        frames = [Image.fromarray(_content(*size, seed)) for seed in range(3)]
        rows = video.video_patch_count(frames, pixel_config, 1 << 30)
        video.video_patches(frames, [0.0, 0.5, 1.0], pixel_config, 1 << 30,
                            np.empty((rows, pixel_config.patch_dim), np.uint8))
    assert [len(k.signatures) for k in compiled] == before


def test_exif_orientation_is_applied():
    upright = load_rgb(_exif_rotated_jpeg(6))
    assert upright.size == (480, 640)  # orientation 6: stored landscape, shown portrait


def test_alpha_is_composited_on_white():
    clear = Image.new("RGBA", (40, 40), (10, 20, 30, 0))
    assert load_rgb(clear).getpixel((5, 5)) == (255, 255, 255)


def test_content_digest_tracks_pixels(pixel_config):
    a = Image.fromarray(_content(300, 200, 1))
    b = Image.fromarray(_content(300, 200, 2))
    digest = image_patches(a, pixel_config).digest
    assert digest == image_patches(a.copy(), pixel_config).digest
    assert digest != image_patches(b, pixel_config).digest
    assert len(digest) == 16


def test_an_items_content_key_is_its_rows_and_grid(pixel_config):
    """One recipe for images and video groups: what the tower reads, nothing else."""
    from qvl_trt.mm import video

    item = image_patches(Image.fromarray(_content(300, 200, 1)), pixel_config)
    t, h, w = item.grid_thw
    assert h != w
    assert ImagePatches(item.pixel_values.copy(), item.grid_thw).digest == item.digest
    assert ImagePatches(item.pixel_values, (t, w, h)).digest != item.digest
    frames = [Image.fromarray(_content(64, 96, seed)) for seed in range(2)]
    rows = video.video_patch_count(frames, pixel_config, 1 << 30)
    (group,) = video.video_patches(frames, [0.0, 0.5], pixel_config, 1 << 30,
                                   np.empty((rows, pixel_config.patch_dim), np.uint8)).groups
    assert ImagePatches(group.pixel_values.copy(), group.grid_thw).digest == group.digest


# ---- bad input -------------------------------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height and holds no pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _tiff() -> bytes:
    return _encoded(Image.new("RGB", (8, 8)), "TIFF")


def _truncated_jpeg() -> bytes:
    data = _encoded(Image.fromarray(_content(200, 200, 4)), "JPEG")
    return data[: len(data) // 3]


@pytest.mark.parametrize("data, message", [
    (b"", "image is empty (0 bytes)"),
    (b"\x00\x01garbage" * 50, "is not a readable JPEG, PNG, WebP, GIF or BMP file"),
    (_truncated_jpeg(), "JPEG image could not be decoded"),
    (_tiff(), "image format TIFF is not accepted"),
    (_png_header_only(9000, 9000), "image of 9000x9000 = 81000000 pixels exceeds the limit"),
    (_png_header_only(30000, 30000), "image refused before decoding"),
    ("photo.jpg", "got a str where an image was expected"),
], ids=["empty", "corrupt", "truncated", "unsupported", "bomb", "pil-bomb", "wrong-type"])
def test_bad_images_are_refused_with_their_message(data, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_rgb(data)


def test_bomb_is_refused_before_decoding():
    # The header declares 9000x9000; the file has no pixel data, so decoding would fail with
    # another message: the size message proves the check ran first.
    with pytest.raises(InputError, match="exceeds the limit of 100 decoded pixels"):
        load_rgb(_png_header_only(20, 20), max_decoded_pixels=100)


def test_image_below_one_merge_block_is_refused(pixel_config):
    no_minimum = pixel_config.with_bounds(0, pixel_config.max_pixels)
    with pytest.raises(InputError, match="smaller than one 32x32 merge block"):
        image_patches(Image.new("RGB", (5, 5)), no_minimum)


def test_extreme_aspect_ratio_is_refused(pixel_config):
    with pytest.raises(InputError, match="aspect ratio above 200:1"):
        image_patches(Image.new("RGB", (2010, 10)), pixel_config)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_are_composited_in_strips_as_hf_does_whole(mode):
    """load_rgb composites on white a strip of rows at a time (to hold one RGB copy, not
    four RGBA ones): the pixels are transformers' `convert_to_rgb` of the whole image, on
    images of several strips and a partial last one."""
    image_transforms = pytest.importorskip("transformers.image_transforms")
    from qvl_trt.mm import image_input

    rng = np.random.default_rng(3)
    height = 2 * image_input._STRIP_ROWS + 37
    if mode == "P":
        image = Image.fromarray(rng.integers(0, 256, (height, 90), np.uint8), "L").convert("P")
        options = {"transparency": 7}
    else:
        bands = len(mode)
        image, options = Image.fromarray(rng.integers(0, 256, (height, 90, bands), np.uint8),
                                         mode), {}
    data = _encoded(image, "PNG", **options)
    hf = image_transforms.convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    assert np.array_equal(np.asarray(load_rgb(data)), hf)
