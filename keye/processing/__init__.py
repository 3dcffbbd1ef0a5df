"""Turning messages (text, images, videos) into Keye-VL model inputs, and responses back into answers.

Public pieces: :class:`KeyeProcessor` and :class:`KeyeBatch` (processor.py), image loading and sizing
(image.py), video decoding and sampling (video.py), slow-fast selection and budgets (slowfast.py), the
chat template, thinking modes and response parsing (chat.py).
"""

from __future__ import annotations

from keye.processing.chat import (
    OFFICIAL_CHAT_TEMPLATE,
    ChatTemplate,
    ParsedResponse,
    apply_mode,
    parse_response,
)
from keye.processing.image import (
    ImageProcessorConfig,
    KeyeImageProcessor,
    fetch_image,
    image_grid_for_size,
    load_image,
    smart_resize,
)
from keye.processing.processor import ImageMeta, KeyeBatch, KeyeProcessor, VideoMeta
from keye.processing.slowfast import SlowFastSizes, classify_frames, rgb_to_hsv_u8, slowfast_sizes
from keye.processing.video import (
    VideoOptions,
    VideoPlan,
    available_backends,
    decode_frames,
    fetch_video,
    plan_video,
    probe_video,
    sample_frames,
)

__all__ = [
    "OFFICIAL_CHAT_TEMPLATE",
    "ChatTemplate",
    "ImageMeta",
    "ImageProcessorConfig",
    "KeyeBatch",
    "KeyeImageProcessor",
    "KeyeProcessor",
    "ParsedResponse",
    "SlowFastSizes",
    "VideoMeta",
    "VideoOptions",
    "VideoPlan",
    "apply_mode",
    "available_backends",
    "classify_frames",
    "decode_frames",
    "fetch_image",
    "fetch_video",
    "image_grid_for_size",
    "load_image",
    "parse_response",
    "plan_video",
    "probe_video",
    "rgb_to_hsv_u8",
    "sample_frames",
    "slowfast_sizes",
    "smart_resize",
]
