"""The architecture numbers of Keye-VL's two towers, as plain dataclasses (no torch, no transformers).

:class:`VisionConfig` is the ``vision_config`` part of the official flat ``config.json``, :class:`TextConfig`
its top level; :class:`keye.config.KeyeVLConfig` holds one of each (and re-exports both). Their defaults
are Keye-VL-8B's. They live apart from :mod:`keye.config`, which needs transformers, so that light modules
can read them (the data pipeline's FLOP model: :class:`keye.data.cost.ModelDims`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class VisionConfig:
    """SigLIP native-resolution tower (``vision_config`` of the flat config).

    ``image_size // patch_size`` is the side of the learned position table (27 for so400m/14),
    which is bilinearly resized to each item's patch grid.
    """

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 384
    patch_size: int = 14
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    attention_dropout: float = 0.0
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: float = 2
    rope_theta: float = 10000.0
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions_side(self) -> int:
        return self.image_size // self.patch_size


@dataclass
class TextConfig:
    """Qwen3 decoder with 3-D multimodal RoPE (the top level of the flat config)."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
