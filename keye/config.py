"""Typed configuration of a Keye-VL model, read from and written to the official *flat* ``config.json``.

The official checkpoints keep the language-model fields at the top level of ``config.json`` and the
vision fields under ``vision_config``. The architecture name tells the variant:

- ``KeyeForConditionalGeneration`` (model_type ``Keye``): Keye-VL-8B-Preview.
- ``KeyeVL1_5ForConditionalGeneration``: Keye-VL-1.5-8B (post-merge projector norm, one vision
  attention segment and one mRoPE block per video frame, slow-fast videos).

Every number the model uses comes from these dataclasses; nothing is hard-coded in the modules.
Keys this module does not model are kept verbatim in ``extra`` so that ``from_dict(d).to_dict()``
preserves the checkpoint's file.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from keye.errors import KeyeConfigError

Variant = Literal["preview", "1.5"]

ARCH_PREVIEW = "KeyeForConditionalGeneration"
ARCH_V15 = "KeyeVL1_5ForConditionalGeneration"
MODEL_TYPE_PREVIEW = "Keye"
MODEL_TYPE_V15 = "KeyeVL1_5"
ATTN_BACKENDS = ("sdpa", "eager", "flash_attention_2")


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


# Top-level keys that belong to TextConfig in the flat file (name in file == field name).
_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "attention_bias",
    "attention_dropout",
    "tie_word_embeddings",
    "initializer_range",
)
_TOKEN_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "vision_token_id",
    "image_token_id",
    "video_token_id",
)
_VISION_KEYS = tuple(f.name for f in dataclasses.fields(VisionConfig) if f.name != "extra")


@dataclass
class KeyeVLConfig:
    """Full model configuration.

    Attributes:
        variant: ``"preview"`` or ``"1.5"``; decides projector norm placement, vision segments and
            video mRoPE blocks.
        text / vision: the two towers.
        *_token_id: special token ids, read from the checkpoint (never assumed).
        projector_ln_eps: eps of ``mlp_AR.pre_norm`` (1e-5 in both official variants).
        attn_implementation: ``sdpa`` (default), ``eager`` or ``flash_attention_2``.
        torch_dtype: the dtype recorded in the checkpoint (``"bfloat16"`` for the 8B models).
        extra: every other top-level key of config.json, kept for a lossless round trip.
    """

    variant: Variant = "preview"
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151645
    pad_token_id: int | None = None
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    vision_token_id: int = 151654
    image_token_id: int = 151655
    video_token_id: int = 151656
    projector_ln_eps: float = 1e-5
    attn_implementation: str = "sdpa"
    torch_dtype: str | None = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise :class:`KeyeConfigError` if the numbers are inconsistent."""
        t, v = self.text, self.vision
        if self.variant not in ("preview", "1.5"):
            raise KeyeConfigError(f"variant must be 'preview' or '1.5', got {self.variant!r}")
        if t.num_attention_heads % t.num_key_value_heads:
            raise KeyeConfigError(
                f"num_attention_heads ({t.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({t.num_key_value_heads})"
            )
        if t.head_dim % 2 or sum(t.mrope_section) * 2 != t.head_dim:
            raise KeyeConfigError(
                f"mrope_section {list(t.mrope_section)} must sum to head_dim/2 = {t.head_dim // 2}"
            )
        if v.hidden_size % v.num_attention_heads:
            raise KeyeConfigError(
                f"vision hidden_size ({v.hidden_size}) must be divisible by its heads ({v.num_attention_heads})"
            )
        if v.head_dim % 4:
            raise KeyeConfigError(f"vision head_dim ({v.head_dim}) must be a multiple of 4 for 2-D RoPE")
        if self.attn_implementation not in ATTN_BACKENDS:
            raise KeyeConfigError(
                f"attn_implementation must be one of {ATTN_BACKENDS}, got {self.attn_implementation!r}"
            )

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def architecture(self) -> str:
        return ARCH_V15 if self.variant == "1.5" else ARCH_PREVIEW

    # --------------------------------------------------------------- flat json
    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> KeyeVLConfig:
        """Build from the official flat config dict (``config.json`` content).

        ``overrides`` set top-level dataclass fields (e.g. ``attn_implementation="eager"``).
        """
        d = copy.deepcopy(d)
        arch = (d.get("architectures") or [None])[0]
        model_type = d.get("model_type")
        if arch == ARCH_V15 or model_type == MODEL_TYPE_V15:
            variant: Variant = "1.5"
        elif arch == ARCH_PREVIEW or model_type == MODEL_TYPE_PREVIEW:
            variant = "preview"
        else:
            raise KeyeConfigError(
                f"not a Keye-VL config: architectures={d.get('architectures')!r}, model_type={model_type!r} "
                f"(expected {ARCH_PREVIEW} or {ARCH_V15})"
            )
        if "text_config" in d and isinstance(d["text_config"], dict):
            # Nested (transformers-port style) configs: flatten the text part into the top level.
            for k, val in d.pop("text_config").items():
                d.setdefault(k, val)
        text_kwargs = {k: d.pop(k) for k in _TEXT_KEYS if k in d}
        if "head_dim" not in text_kwargs and "hidden_size" in text_kwargs:
            text_kwargs["head_dim"] = text_kwargs["hidden_size"] // text_kwargs.get("num_attention_heads", 32)
        rope_scaling = d.get("rope_scaling") or {}
        if isinstance(rope_scaling, dict) and "mrope_section" in rope_scaling:
            text_kwargs["mrope_section"] = tuple(int(x) for x in rope_scaling["mrope_section"])
        elif "rope_parameters" in d and "mrope_section" in (d["rope_parameters"] or {}):
            text_kwargs["mrope_section"] = tuple(int(x) for x in d["rope_parameters"]["mrope_section"])
        text = TextConfig(**text_kwargs)

        vd = dict(d.pop("vision_config", None) or {})
        vision_kwargs = {k: vd.pop(k) for k in _VISION_KEYS if k in vd}
        vision = VisionConfig(**vision_kwargs, extra=vd)

        kwargs: dict[str, Any] = {k: d.pop(k) for k in _TOKEN_KEYS if k in d}
        kwargs["torch_dtype"] = d.pop("torch_dtype", d.pop("dtype", None))
        if "projector_ln_eps" in d:
            kwargs["projector_ln_eps"] = d.pop("projector_ln_eps")
        kwargs.update(overrides)
        return cls(variant=variant, text=text, vision=vision, extra=d, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Return the official flat config dict (loadable by the official code and vLLM)."""
        d = copy.deepcopy(self.extra)
        d["architectures"] = [self.architecture]
        if self.variant == "preview":
            d["model_type"] = MODEL_TYPE_PREVIEW
            d.setdefault(
                "auto_map",
                {
                    "AutoConfig": "configuration_keye.KeyeConfig",
                    "AutoModel": "modeling_keye.KeyeForConditionalGeneration",
                    "AutoModelForCausalLM": "modeling_keye.KeyeForConditionalGeneration",
                },
            )
        else:
            d.setdefault("model_type", MODEL_TYPE_V15)
        for k in _TEXT_KEYS:
            d[k] = getattr(self.text, k)
        rope_scaling = dict(d.get("rope_scaling") or {})
        rope_scaling.setdefault("type", "mrope")
        rope_scaling["mrope_section"] = list(self.text.mrope_section)
        d["rope_scaling"] = rope_scaling
        for k in _TOKEN_KEYS:
            val = getattr(self, k)
            if val is not None or k in self.extra:
                d[k] = val
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.projector_ln_eps != 1e-5:
            d["projector_ln_eps"] = self.projector_ln_eps
        vd = copy.deepcopy(self.vision.extra)
        vd.setdefault("model_type", "siglip_vision_model")
        for k in _VISION_KEYS:
            vd[k] = getattr(self.vision, k)
        d["vision_config"] = vd
        return d

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides: Any) -> KeyeVLConfig:
        """Read ``config.json`` (a file, or a directory containing it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise KeyeConfigError(f"{path}: no config.json found") from None
        except json.JSONDecodeError as err:
            raise KeyeConfigError(f"{path}: invalid JSON ({err})") from None
        try:
            return cls.from_dict(d, **overrides)
        except TypeError as err:
            raise KeyeConfigError(f"{path}: unexpected config field ({err})") from None

    def to_json_file(self, path: str | Path) -> None:
        """Write the official flat ``config.json`` (``path`` may be a directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")


def tiny_config(variant: Variant = "preview", **overrides: Any) -> KeyeVLConfig:
    """A named tiny config for tests and examples (a few hundred thousand parameters).

    ``"preview"`` has exactly the sizes and token ids of ``tests/fixtures/golden/keye_preview_tiny``
    (vocab 512, special tokens from 480). ``"1.5"`` is the same with the 1.5 architecture and a
    vocabulary of 520 so that ``<|frame|>``, ``<|fast_start|>`` and ``<|fast_end|>`` (512-514) fit.
    """
    text = TextConfig(
        vocab_size=512 if variant == "preview" else 520,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mrope_section=(2, 3, 3),
        max_position_embeddings=40960,
    )
    vision = VisionConfig(
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=112,
        patch_size=14,
    )
    kw: dict[str, Any] = dict(
        variant=variant,
        text=text,
        vision=vision,
        bos_token_id=480,
        eos_token_id=482,
        vision_start_token_id=489,
        vision_end_token_id=490,
        vision_token_id=491,
        image_token_id=492,
        video_token_id=493,
        torch_dtype="float32",
    )
    kw.update(overrides)
    return KeyeVLConfig(**kw)
