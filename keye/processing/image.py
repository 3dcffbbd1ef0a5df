"""Image loading, Keye's ``smart_resize`` rules, rescale + normalise and raster patchify.

Two resize stages exist in the official pipeline (architecture.md §8):

1. the user-side helper (keye-vl-utils ``fetch_image``) pre-resizes with Pillow to multiples of 28 inside
   its own pixel window;
2. the checkpoint's image processor resizes again only when the size falls outside *its*
   ``[min_pixels, max_pixels]`` window, rescales by 1/255, normalises and cuts 14x14 patches.

``fetch_image`` implements stage 1, :class:`KeyeImageProcessor` stage 2, and
:func:`image_grid_for_size` runs both on sizes alone (no pixels), for cost models.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from keye.errors import KeyeConfigError, KeyeInputError
from keye.processing.resample import resize_uint8

PREVIEW = "preview"
V1_5 = "1.5"
VARIANTS = (PREVIEW, V1_5)

IMAGE_FACTOR = 28
MAX_ASPECT_RATIO = 200
# keye-vl-utils stage-1 image bounds (architecture.md §8.1).
FETCH_MIN_PIXELS = {PREVIEW: 4 * 28 * 28, V1_5: 4 * 28 * 28}
FETCH_MAX_PIXELS = {PREVIEW: 16384 * 28 * 28, V1_5: 20480 * 28 * 28}
# Smallest side we accept: below 4 pixels an image carries no usable content and smart_resize would
# blow it up by 7x or more (the reference accepts it silently).
MIN_IMAGE_SIDE = 4
URL_TIMEOUT_S = 30.0


def check_variant(variant: str) -> str:
    """Return ``variant`` if it is ``"preview"`` or ``"1.5"``; raise :class:`KeyeConfigError` otherwise."""
    if variant not in VARIANTS:
        raise KeyeConfigError(f"unknown Keye variant {variant!r}; expected one of {VARIANTS}")
    return variant


def _round_half_even(x: float) -> int:
    # Python's round() is banker's rounding, which the reference relies on.
    return int(round(x))


def _check_aspect(height: int, width: int, item: Any = None, path: Any = None) -> None:
    if height < MIN_IMAGE_SIDE or width < MIN_IMAGE_SIDE:
        raise KeyeInputError(
            f"image is too small ({width}x{height} pixels; at least {MIN_IMAGE_SIDE} per side)",
            item=item,
            path=path,
        )
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise KeyeInputError(
            f"extreme aspect ratio {ratio:.1f} ({width}x{height}); at most {MAX_ASPECT_RATIO} is supported",
            item=item,
            path=path,
        )


def smart_resize(
    height: int,
    width: int,
    factor: int = IMAGE_FACTOR,
    min_pixels: float = FETCH_MIN_PIXELS[PREVIEW],
    max_pixels: float = FETCH_MAX_PIXELS[PREVIEW],
    *,
    clamp_min_side: bool = False,
    item: Any = None,
    path: Any = None,
) -> tuple[int, int]:
    """keye-vl-utils / Qwen2-VL ``smart_resize`` (architecture.md §8.1).

    Returns ``(new_height, new_width)``, both multiples of ``factor``, with area inside
    ``[min_pixels, max_pixels]`` where possible and the aspect ratio kept approximately.
    ``clamp_min_side`` adds the keye-vl-utils 1.5.2 final ``>= factor`` clamp.
    Raises :class:`KeyeInputError` for an aspect ratio above 200 or an empty image.
    """
    _check_aspect(height, width, item, path)
    h_bar = max(factor, _round_half_even(height / factor) * factor)
    w_bar = max(factor, _round_half_even(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if clamp_min_side:
        h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
    if h_bar < factor or w_bar < factor:
        raise KeyeInputError(
            f"cannot fit a {width}x{height} image into max_pixels={max_pixels:g} with {factor}-pixel tiles",
            item=item,
            path=path,
        )
    return h_bar, w_bar


def smart_resize_preview_processor(
    height: int,
    width: int,
    factor: int = IMAGE_FACTOR,
    min_pixels: float = 3136,
    max_pixels: float = 1003520,
    *,
    item: Any = None,
    path: Any = None,
) -> tuple[int, int]:
    """The preview image processor's ``smart_resize`` (architecture.md §8.2).

    Differs from :func:`smart_resize` by first scaling a side below ``factor`` up to ``factor`` (keeping
    the aspect ratio, Python rounding) and by having no final clamp. Returns ``(height, width)``.
    """
    _check_aspect(height, width, item, path)
    if height < factor:
        width = _round_half_even(width * factor / height)
        height = factor
    if width < factor:
        height = _round_half_even(height * factor / width)
        width = factor
    return smart_resize(height, width, factor, min_pixels, max_pixels, item=item, path=path)


# ----------------------------------------------------------------------------------------------------------
# Loading


def _open_pil(data: bytes | str | Path, item: Any, path: Any) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
        img.load()
    except FileNotFoundError as err:
        raise KeyeInputError("image file not found", item=item, path=path) from err
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
        raise KeyeInputError(
            f"cannot decode image ({err.__class__.__name__}: {err})", item=item, path=path
        ) from err
    return img


def read_source_bytes(src: str, item: Any = None, kind: str = "image") -> tuple[bytes | None, str | None]:
    """Resolve a string source to ``(bytes, None)`` for URLs / data URIs or ``(None, local_path)``.

    Accepts plain paths, ``file://`` URIs, ``http(s)://`` URLs (downloaded with a 30 s timeout) and
    ``data:<mime>;base64,`` URIs. Raises :class:`KeyeInputError` for a missing file, a failed download,
    a bad data URI or an unknown scheme.
    """
    if src.startswith("data:"):
        head, _, payload = src.partition(",")
        if ";base64" not in head or not payload:
            raise KeyeInputError(f"data URI for an {kind} must be base64 ('data:...;base64,...')", item=item)
        try:
            return base64.b64decode(payload, validate=True), None
        except ValueError as err:
            raise KeyeInputError(f"invalid base64 payload in data URI ({err})", item=item) from err
    if src.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(src, timeout=URL_TIMEOUT_S) as resp:  # noqa: S310 (user asked for it)
                return resp.read(), None
        except Exception as err:  # network errors come in many types (URLError, timeout, HTTPError)
            raise KeyeInputError(f"cannot download {kind} ({err})", item=item, path=src) from err
    if src.startswith("file://"):
        local = urllib.parse.unquote(urllib.parse.urlparse(src).path)
    elif "://" in src:
        raise KeyeInputError(f"unsupported URL scheme in {src!r}", item=item, path=src)
    else:
        local = src
    if not os.path.isfile(local):
        raise KeyeInputError(f"{kind} file not found", item=item, path=local)
    return None, local


def _to_rgb(img: Image.Image, variant: str) -> Image.Image:
    if img.mode == "RGB":
        return img
    if variant == PREVIEW and img.mode in ("RGBA", "LA", "P"):
        # keye-vl-utils 1.0.0 composites transparency onto white; 1.5.2 just drops alpha.
        rgba = img.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.split()[3])
        return white
    return img.convert("RGB")


def array_to_pil(arr: Any, item: Any = None) -> Image.Image:
    """Convert a numpy array / torch tensor image to a PIL RGB image.

    Accepts uint8 ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]`` (C in 1, 3, 4), or floats in [0, 1]
    (scaled by 255 and rounded). Raises :class:`KeyeInputError` for other shapes or dtypes.
    """
    if isinstance(arr, torch.Tensor):
        arr = arr.detach().cpu().numpy()
    arr = np.asarray(arr)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (3, 4)):
        raise KeyeInputError(
            f"image array must be [H,W], [H,W,C] or [C,H,W]; got shape {arr.shape}", item=item
        )
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.floating):
            raise KeyeInputError(f"image array must be uint8 or float in [0,1]; got {arr.dtype}", item=item)
        if arr.size and (np.nanmin(arr) < 0 or np.nanmax(arr) > 1):
            raise KeyeInputError("float image array must have values in [0, 1]", item=item)
        arr = np.clip(np.rint(arr * 255), 0, 255).astype(np.uint8)
    if arr.size == 0:
        raise KeyeInputError(f"image array is empty (shape {arr.shape})", item=item)
    return Image.fromarray(np.ascontiguousarray(arr))


def load_image(src: Any, variant: str = PREVIEW, item: Any = None) -> Image.Image:
    """Load an image from a path, ``file://``, ``http(s)://``, ``data:image/...;base64,``, a PIL image or
    a numpy / torch array, and convert it to RGB (alpha handled per ``variant``, §8.1).

    Raises :class:`KeyeInputError` naming ``item`` and the file for anything unreadable.
    """
    path = None
    if isinstance(src, Image.Image):
        img = src
    elif isinstance(src, (np.ndarray, torch.Tensor)):
        img = array_to_pil(src, item)
    elif isinstance(src, (str, Path)):
        path = str(src)
        data, local = read_source_bytes(path, item, "image")
        img = _open_pil(data if data is not None else local, item, path)
    else:
        raise KeyeInputError(f"unsupported image source of type {type(src).__name__}", item=item)
    w, h = img.size
    _check_aspect(h, w, item, path)
    return _to_rgb(img, variant)


def fetch_image(
    src: Any,
    variant: str = PREVIEW,
    *,
    min_pixels: float | None = None, max_pixels: float | None = None,
    resized_height: int | None = None, resized_width: int | None = None,
    item: Any = None,
) -> Image.Image:
    """Stage 1 (keye-vl-utils ``fetch_image``): :func:`load_image` then :func:`prepare_image`.

    Returns an RGB PIL image whose sides are multiples of 28.
    """
    img = load_image(src, variant, item)
    path = src if isinstance(src, (str, Path)) else None
    return prepare_image(img, variant, min_pixels=min_pixels, max_pixels=max_pixels, resized_height=resized_height,
                         resized_width=resized_width, item=item, path=path)


def prepare_image(
    img: Image.Image,
    variant: str = PREVIEW,
    *,
    min_pixels: float | None = None, max_pixels: float | None = None,
    resized_height: int | None = None, resized_width: int | None = None,
    item: Any = None,
    path: Any = None,
) -> Image.Image:
    """Resize a loaded RGB image to keye-vl-utils' ``smart_resize`` size (BICUBIC, Pillow 13.0's maths and
    pass order, see :mod:`keye.processing.resample`).

    ``min_pixels``/``max_pixels`` default to the variant's stage-1 bounds (§8.1);
    ``resized_height``/``resized_width`` (both) replace the source size before smart_resize, as the
    reference does.
    """
    lo = FETCH_MIN_PIXELS[variant] if min_pixels is None else min_pixels
    hi = FETCH_MAX_PIXELS[variant] if max_pixels is None else max_pixels
    if (resized_height is None) != (resized_width is None):
        raise KeyeInputError("give both resized_height and resized_width, or neither", item=item, path=path)
    clamp = variant == V1_5
    if resized_height is not None:
        new_h, new_w = smart_resize(
            int(resized_height), int(resized_width), IMAGE_FACTOR, clamp_min_side=clamp, item=item, path=path
        )
    else:
        new_h, new_w = smart_resize(
            img.height, img.width, IMAGE_FACTOR, lo, hi, clamp_min_side=clamp, item=item, path=path
        )
    if (new_w, new_h) != img.size:
        # Pillow's default filter for RGB is BICUBIC, as in the reference.
        img = Image.fromarray(resize_uint8(np.asarray(img), new_h, new_w, 3))
    return img


# ----------------------------------------------------------------------------------------------------------
# Stage 2: the checkpoint's image processor


@dataclass
class ImageProcessorConfig:
    """The fields of ``preprocessor_config.json`` the processor uses.

    ``resample`` is a PIL filter id (3 = BICUBIC, 2 = BILINEAR). ``variant`` selects the smart_resize
    flavour: the preview processor's (small-side pre-scale) or the 1.5 / Qwen2-VL one.
    """

    min_pixels: int = 3136
    max_pixels: int = 1003520
    patch_size: int = 14
    temporal_patch_size: int = 1
    merge_size: int = 2
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    resample: int = 3
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    # Checkpoint-level defaults of the per-item video options (fps, max_frames, min/max/total_pixels,
    # floor_pixels, ...); an item's own keys win. Empty for the official checkpoints.
    video_defaults: dict[str, Any] = field(default_factory=dict)
    variant: str = PREVIEW

    @property
    def factor(self) -> int:
        """Resize factor in pixels (patch_size x merge_size = 28)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, Any], variant: str = PREVIEW) -> ImageProcessorConfig:
        """Build from a ``preprocessor_config.json`` dict; unknown keys are ignored."""
        names = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in names and k != "variant"}
        if "resample" not in d:
            # The 1.5 port defaults to bilinear, the preview processor to bicubic (§8.4).
            kw["resample"] = 2 if variant == V1_5 else 3
        cfg = cls(**kw, variant=check_variant(variant))
        if cfg.merge_size < 1 or cfg.patch_size < 1 or cfg.min_pixels > cfg.max_pixels:
            raise KeyeConfigError(f"invalid image processor config: {d}")
        if cfg.temporal_patch_size != 1:
            # Both Keye processors tile frames with temporal_patch_size 1 (§8.2, gotcha 12).
            raise KeyeConfigError(
                f"temporal_patch_size must be 1 for Keye processors, got {cfg.temporal_patch_size}"
            )
        return cfg

    @classmethod
    def from_file(cls, path: str | Path, variant: str = PREVIEW) -> ImageProcessorConfig:
        """Read ``preprocessor_config.json``; raises :class:`KeyeConfigError` if unreadable."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise KeyeConfigError(f"cannot read image processor config {path}: {err}") from err
        return cls.from_dict(d, variant)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (what ``save_pretrained`` writes, plus ``processor_class``)."""
        d = asdict(self)
        d.pop("variant")
        if not d["video_defaults"]:
            d.pop("video_defaults")
        return d


def patchify(frames: np.ndarray, patch_size: int = 14) -> np.ndarray:
    """Cut ``[T, C, H, W]`` into raster-ordered patches ``[T*(H/p)*(W/p), C, p, p]`` (§8.3).

    Rows go frame, patch-row, patch-column. ``H`` and ``W`` must be multiples of ``patch_size``.
    """
    t, c, h, w = frames.shape
    gh, gw = h // patch_size, w // patch_size
    x = frames.reshape(t, c, gh, patch_size, gw, patch_size)
    x = x.transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(t * gh * gw, c, patch_size, patch_size))


class KeyeImageProcessor:
    """Stage 2: the checkpoint's image processor (resize if needed, rescale, normalise, patchify).

    Outputs match the reference ``SiglipImageProcessor`` (preview) bit for bit: ``pixel_values`` float32
    ``[sum T*h*w, 3, 14, 14]`` and grids ``[T, h, w]`` in 14-pixel patch units.
    """

    def __init__(self, config: ImageProcessorConfig | None = None):
        self.config = config or ImageProcessorConfig()

    def target_size(self, height: int, width: int, item: Any = None, path: Any = None) -> tuple[int, int]:
        """The ``(height, width)`` this processor resizes an ``height x width`` input to."""
        c = self.config
        if not c.do_resize:
            if height % c.factor or width % c.factor:
                raise KeyeInputError(
                    f"do_resize is off but {width}x{height} is not a multiple of {c.factor}",
                    item=item,
                    path=path,
                )
            return height, width
        if c.variant == PREVIEW:
            return smart_resize_preview_processor(
                height, width, c.factor, c.min_pixels, c.max_pixels, item=item, path=path
            )
        return smart_resize(
            height, width, c.factor, c.min_pixels, c.max_pixels, clamp_min_side=True, item=item, path=path
        )

    def _pixel_maths(self, x: np.ndarray) -> np.ndarray:
        c = self.config
        if c.do_rescale:
            x = (x.astype(np.float64) * c.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if c.do_normalize:
            mean = np.asarray(c.image_mean, dtype=np.float32)
            std = np.asarray(c.image_std, dtype=np.float32)
            x = (x - mean) / std
        return x

    def normalize(self, frames_u8: np.ndarray) -> np.ndarray:
        """uint8 (or integer-valued float) ``[T, H, W, C]`` -> float32 ``[T, C, H, W]``.

        Rescale is computed in float64 and stored as float32, then ``(x - mean) / std`` in float32, as
        transformers does. uint8 input goes through a per-channel 256-entry table holding exactly those
        values (same bits, ~10x faster on video).
        """
        if frames_u8.dtype == np.uint8:
            levels = np.repeat(np.arange(256, dtype=np.uint8)[:, None], frames_u8.shape[-1], axis=1)
            lut = self._pixel_maths(levels)  # [256, C], computed by the exact same maths
            t, h, w, c = frames_u8.shape
            out = np.empty((t, c, h, w), np.float32)
            for ch in range(c):
                out[:, ch] = lut[:, ch][frames_u8[..., ch]]
            return out
        return np.ascontiguousarray(self._pixel_maths(frames_u8).transpose(0, 3, 1, 2))

    def preprocess_frames(
        self, frames: list[Image.Image] | np.ndarray, size_hw: tuple[int, int] | None = None, item: Any = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Process one image (a 1-element list) or the frames of one video.

        ``frames`` is a list of PIL RGB images or a uint8 array ``[T, H, W, 3]``. All frames are resized
        (Pillow 13.0-exact maths and pass order, the configured filter, skipped when the size already
        matches) to ``size_hw`` or to the target size of the first frame. Returns
        ``(pixel_values float32 [T*h*w, 3, 14, 14], [T, h, w])``.
        """
        if isinstance(frames, np.ndarray):
            if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
                raise KeyeInputError(
                    f"video array must be uint8 [T,H,W,3]; got {frames.dtype} {frames.shape}", item=item
                )
            arrays = frames
        else:
            arrays = [np.asarray(f, dtype=np.uint8) for f in frames]
        if len(arrays) == 0:
            raise KeyeInputError("no frames to process", item=item)
        if size_hw is None:
            size_hw = self.target_size(arrays[0].shape[0], arrays[0].shape[1], item=item)
        if all(a.shape[:2] == tuple(size_hw) for a in arrays):
            arr = arrays if isinstance(arrays, np.ndarray) else np.stack(arrays)
        else:
            r = self.config.resample
            arr = np.stack(
                [a if a.shape[:2] == tuple(size_hw) else resize_uint8(a, *size_hw, r) for a in arrays]
            )
        return self._finish(arr)

    def preprocess_resized(self, frames_u8: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Rescale/normalise/patchify frames that are already at their final size (``do_resize=False``).

        ``frames_u8``: ``[T, H, W, 3]`` numpy or ``[T, 3, H, W]`` torch tensor, uint8 or integer-valued
        float, with H and W multiples of 28. Returns ``(pixel_values, [T, h, w])``.
        """
        if isinstance(frames_u8, torch.Tensor):
            frames_u8 = frames_u8.permute(0, 2, 3, 1).cpu().numpy()
        return self._finish(frames_u8)

    def _finish(self, arr_thwc: np.ndarray) -> tuple[torch.Tensor, list[int]]:
        c = self.config
        t, h, w, _ = arr_thwc.shape
        pv = patchify(self.normalize(arr_thwc), c.patch_size)
        return torch.from_numpy(pv), [t, h // c.patch_size, w // c.patch_size]

    def __call__(self, image: Image.Image, item: Any = None) -> tuple[torch.Tensor, list[int]]:
        """Process one RGB PIL image -> ``(pixel_values [h*w, 3, 14, 14], [1, h, w])``."""
        return self.preprocess_frames([image], item=item)


def image_grid_for_size(
    height: int,
    width: int,
    variant: str = PREVIEW,
    *,
    min_pixels: float | None = None, max_pixels: float | None = None,
    resized_height: int | None = None, resized_width: int | None = None,
    processor_config: ImageProcessorConfig | None = None,
) -> tuple[int, int, int]:
    """Grid ``(1, h, w)`` in 14-pixel patches an image of ``height x width`` gets, without decoding it.

    Runs stage 1 (per-item ``min_pixels``/``max_pixels``/``resized_*``) then the processor's own
    smart_resize. LLM tokens = ``h * w // 4``. Raises :class:`KeyeInputError` like the real path.
    """
    cfg = processor_config or ImageProcessorConfig(variant=variant, resample=2 if variant == V1_5 else 3)
    lo = FETCH_MIN_PIXELS[variant] if min_pixels is None else min_pixels
    hi = FETCH_MAX_PIXELS[variant] if max_pixels is None else max_pixels
    if (resized_height is None) != (resized_width is None):
        raise KeyeInputError("give both resized_height and resized_width, or neither")
    h0, w0 = (height, width) if resized_height is None else (int(resized_height), int(resized_width))
    if resized_height is not None:
        h1, w1 = smart_resize(h0, w0, IMAGE_FACTOR, clamp_min_side=variant == V1_5)
    else:
        _check_aspect(height, width)
        h1, w1 = smart_resize(h0, w0, IMAGE_FACTOR, lo, hi, clamp_min_side=variant == V1_5)
    h2, w2 = KeyeImageProcessor(cfg).target_size(h1, w1)
    return 1, h2 // cfg.patch_size, w2 // cfg.patch_size
