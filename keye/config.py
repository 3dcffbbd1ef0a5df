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
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedConfig

from keye.errors import KeyeConfigError
from keye.model.arch import TextConfig, VisionConfig

Variant = Literal["preview", "1.5"]

ARCH_PREVIEW = "KeyeForConditionalGeneration"
ARCH_V15 = "KeyeVL1_5ForConditionalGeneration"
MODEL_TYPE_PREVIEW = "Keye"
MODEL_TYPE_V15 = "KeyeVL1_5"
ATTN_BACKENDS = ("sdpa", "eager", "flash_attention_2")


# Top-level keys that belong to TextConfig in the flat file (name in file == field name); mrope_section
# is kept in the file's rope_scaling instead.
_TEXT_KEYS = tuple(f.name for f in dataclasses.fields(TextConfig) if f.name != "mrope_section")
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


def _split_flat(d: dict[str, Any]) -> dict[str, Any]:
    """Official flat config dict -> :class:`KeyeVLConfig` constructor arguments (``d`` is consumed)."""
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
    _read_rope_base(d, text_kwargs)
    text = TextConfig(**text_kwargs)

    vd = dict(d.pop("vision_config", None) or {})
    vision_kwargs = {k: vd.pop(k) for k in _VISION_KEYS if k in vd}
    vision = VisionConfig(**vision_kwargs, extra=vd)

    kwargs: dict[str, Any] = {k: d.pop(k) for k in _TOKEN_KEYS if k in d}
    kwargs["torch_dtype"] = d.pop("torch_dtype", d.pop("dtype", None))
    if "projector_ln_eps" in d:
        kwargs["projector_ln_eps"] = d.pop("projector_ln_eps")
    if "attn_implementation" in d:
        kwargs["attn_implementation"] = d.pop("attn_implementation")
    # Loader bookkeeping transformers may pass along; it is not part of the checkpoint's file.
    for key in ("name_or_path", "_name_or_path"):
        d.pop(key, None)
    return dict(variant=variant, text=text, vision=vision, extra=d, **kwargs)


# RoPE types the text model implements: plain rotary frequencies over 3-D positions (Qwen2-VL's file says "mrope",
# its config class renames it "default"); a context extension by a larger base (Keye-VL-1.5: 8e6) is still these.
_ROPE_TYPES = (None, "default", "mrope")


def _read_rope_base(d: dict[str, Any], text_kwargs: dict[str, Any]) -> None:
    """Take the RoPE base from the file wherever it is written, and refuse a RoPE the model does not implement.

    transformers 5 writes ``rope_theta`` inside ``rope_parameters`` (older files: at the top level, read with the
    other text keys); without this a file holding only the nested value would run at the dataclass default base,
    silently wrong beyond short contexts. Scaled variants (linear, dynamic NTK, YaRN, ...) change the frequencies
    in ways keye does not compute, so they raise instead of running as plain RoPE.
    """
    nested = {}
    for key in ("rope_scaling", "rope_parameters"):
        section = d.get(key)
        if not isinstance(section, dict):
            continue
        kind = section.get("rope_type", section.get("type"))
        if kind not in _ROPE_TYPES:
            raise KeyeConfigError(f"{key} asks for RoPE type {kind!r}; keye implements {[t for t in _ROPE_TYPES if t]}"
                                  " (a longer context with a larger rope_theta needs no scaling type)")
        if "rope_theta" in section:
            nested[key] = section["rope_theta"]
    values = {float(v) for v in nested.values()} | (
        {float(text_kwargs["rope_theta"])} if "rope_theta" in text_kwargs else set())
    if len(values) > 1:
        where = ", ".join(f"{k}.rope_theta={v}" for k, v in nested.items())
        top = f"rope_theta={text_kwargs['rope_theta']}, " if "rope_theta" in text_kwargs else ""
        raise KeyeConfigError(f"the file gives two RoPE bases: {top}{where}")
    if "rope_theta" not in text_kwargs and nested:
        text_kwargs["rope_theta"] = next(iter(nested.values()))


def _text_property(name: str) -> property:
    """A top-level alias of ``config.text.<name>`` (transformers reads e.g. ``config.num_hidden_layers``)."""

    def get(self):
        return getattr(self.text, name)

    def set_(self, value):
        setattr(self.text, name, value)

    return property(get, set_, doc=f"Alias of ``text.{name}``.")


class KeyeVLConfig(PreTrainedConfig):
    """Full model configuration, a transformers ``PreTrainedConfig`` read from and written to the official
    flat ``config.json``.

    Constructed either from typed parts (``KeyeVLConfig(variant=..., text=TextConfig(...),
    vision=VisionConfig(...), ...)``) or, as transformers does, from the flat keys of the file
    (``KeyeVLConfig(**json.load(f))``). ``KeyeVLConfig(variant="1.5", ...)`` returns a
    :class:`KeyeVL1_5Config` so that the model type (``"Keye"`` or ``"KeyeVL1_5"``) matches the file.

    Attributes:
        variant: ``"preview"`` or ``"1.5"``; decides projector norm placement, vision segments and
            video mRoPE blocks.
        text / vision: the two towers (the text fields are also readable at the top level,
            e.g. ``config.num_hidden_layers``, as transformers expects).
        *_token_id: special token ids, read from the checkpoint (never assumed).
        projector_ln_eps: eps of ``mlp_AR.pre_norm`` (1e-5 in both official variants).
        attn_implementation: ``sdpa`` (default), ``eager`` or ``flash_attention_2``.
        torch_dtype: the dtype recorded in the checkpoint as a string (``"bfloat16"`` for the 8B models).
        extra: every other top-level key of config.json, kept for a lossless round trip.
    """

    model_type = MODEL_TYPE_PREVIEW

    def __new__(cls, *args: Any, **kwargs: Any):
        variant = kwargs.get("variant")
        if variant is None and ("architectures" in kwargs or "model_type" in kwargs):
            arch = (kwargs.get("architectures") or [None])[0]
            variant = "1.5" if arch == ARCH_V15 or kwargs.get("model_type") == MODEL_TYPE_V15 else None
        if cls is KeyeVLConfig and variant == "1.5":
            cls = KeyeVL1_5Config
        return super().__new__(cls)

    def __init__(
        self,
        variant: Variant | None = None,
        text: TextConfig | None = None,
        vision: VisionConfig | None = None,
        bos_token_id: int | None = 151643,
        eos_token_id: int | list[int] | None = 151645,
        pad_token_id: int | None = None,
        vision_start_token_id: int = 151652,
        vision_end_token_id: int = 151653,
        vision_token_id: int = 151654,
        image_token_id: int = 151655,
        video_token_id: int = 151656,
        projector_ln_eps: float = 1e-5,
        attn_implementation: str | None = "sdpa",
        torch_dtype: str | None = "bfloat16",
        extra: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        base = {k: kwargs.pop(k) for k in _BASE_FIELDS if k in kwargs}
        if kwargs.get("dtype") is not None and torch_dtype == "bfloat16":
            torch_dtype = kwargs.pop("dtype")
        kwargs.pop("dtype", None)
        if text is None and vision is None and any(k in kwargs for k in _FLAT_MARKERS):
            # Flat keys of an official config.json (transformers builds configs as ``cls(**config_dict)``).
            flat = dict(kwargs, bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                        vision_start_token_id=vision_start_token_id, vision_end_token_id=vision_end_token_id,
                        vision_token_id=vision_token_id, image_token_id=image_token_id,
                        video_token_id=video_token_id, torch_dtype=torch_dtype, projector_ln_eps=projector_ln_eps)
            if attn_implementation is not None:
                flat["attn_implementation"] = attn_implementation
            if "architectures" not in flat and "model_type" not in flat:
                flat["model_type"] = MODEL_TYPE_V15 if (variant or self._default_variant) == "1.5" else MODEL_TYPE_PREVIEW
            parts = _split_flat(flat)
            variant, text, vision = parts.pop("variant"), parts.pop("text"), parts.pop("vision")
            extra = {**(extra or {}), **parts.pop("extra")}
            bos_token_id, eos_token_id, pad_token_id = (parts[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
            vision_start_token_id, vision_end_token_id = parts["vision_start_token_id"], parts["vision_end_token_id"]
            vision_token_id, image_token_id = parts["vision_token_id"], parts["image_token_id"]
            video_token_id, projector_ln_eps = parts["video_token_id"], parts["projector_ln_eps"]
            torch_dtype = parts["torch_dtype"]
            attn_implementation = parts.get("attn_implementation", attn_implementation)
            kwargs = {}
        self.variant = variant or self._default_variant
        self.text = text if text is not None else TextConfig()
        self.vision = vision if vision is not None else VisionConfig()
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.vision_token_id = vision_token_id
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.projector_ln_eps = projector_ln_eps
        self.extra = dict(extra or {})
        # Unknown top-level keys are kept verbatim (not as attributes) for the lossless round trip.
        self.extra.update(kwargs)
        super().__init__(dtype=_dtype_name(torch_dtype), attn_implementation=attn_implementation or "sdpa", **base)
        self.validate()

    _default_variant = "preview"

    # ------------------------------------------------------------------ transformers surface
    vocab_size = _text_property("vocab_size")
    hidden_size = _text_property("hidden_size")
    intermediate_size = _text_property("intermediate_size")
    num_hidden_layers = _text_property("num_hidden_layers")
    num_attention_heads = _text_property("num_attention_heads")
    num_key_value_heads = _text_property("num_key_value_heads")
    head_dim = _text_property("head_dim")
    rms_norm_eps = _text_property("rms_norm_eps")
    rope_theta = _text_property("rope_theta")
    max_position_embeddings = _text_property("max_position_embeddings")
    tie_word_embeddings = _text_property("tie_word_embeddings")
    initializer_range = _text_property("initializer_range")

    @property
    def attn_implementation(self) -> str:
        """The attention backend name (``sdpa``, ``eager`` or ``flash_attention_2``)."""
        return self._attn_implementation or "sdpa"

    @attn_implementation.setter
    def attn_implementation(self, value: str) -> None:
        self._attn_implementation = value

    @property
    def torch_dtype(self) -> str | None:
        """The recorded weight dtype as a string (``"bfloat16"``), or None."""
        return None if self.dtype is None else str(self.dtype).removeprefix("torch.")

    @torch_dtype.setter
    def torch_dtype(self, value: Any) -> None:
        self.dtype = None if value is None else getattr(torch, _dtype_name(value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeyeVLConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(variant={self.variant!r}, text={self.text!r}, vision={self.vision!r})"

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
        """``eos_token_id`` as a list (empty when unset)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def architecture(self) -> str:
        """The official architecture name of this variant."""
        return ARCH_V15 if self.variant == "1.5" else ARCH_PREVIEW

    # --------------------------------------------------------------- flat json
    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **overrides: Any) -> KeyeVLConfig:
        """Build from the official flat config dict (``config.json`` content).

        ``overrides`` set top-level fields (e.g. ``attn_implementation="eager"``). Called by
        transformers' ``from_pretrained`` too: ``return_unused_kwargs=True`` then returns
        ``(config, unused)`` with the keyword arguments that are not config fields.
        """
        return_unused = overrides.pop("return_unused_kwargs", False)
        unused = {}
        for key in list(overrides):
            if key in ("_from_auto", "_from_pipeline", "name_or_path"):
                overrides.pop(key)
            elif key in ("torch_dtype", "dtype"):
                value = overrides.pop(key)
                if value not in (None, "auto"):
                    overrides["torch_dtype"] = _dtype_name(value)
            elif key not in _OVERRIDABLE:
                unused[key] = overrides.pop(key)
        if unused and not return_unused:
            raise KeyeConfigError(f"unexpected config field(s): {', '.join(sorted(unused))}")
        parts = _split_flat(copy.deepcopy(config_dict))
        parts.update(overrides)
        target = KeyeVL1_5Config if parts["variant"] == "1.5" else KeyeVLConfig
        if issubclass(cls, target):
            target = cls
        config = target(**parts)
        return (config, unused) if return_unused else config

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

    def to_diff_dict(self) -> dict[str, Any]:
        """The flat dict (the official file has no notion of "differences from defaults")."""
        return self.to_dict()

    def to_json_string(self, use_diff: bool = True) -> str:
        """``config.json`` text in the official flat format (``use_diff`` is accepted and ignored)."""
        del use_diff
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

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

    def to_json_file(self, path: str | Path, use_diff: bool = True) -> None:
        """Write the official flat ``config.json`` (``path`` may be a directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(self.to_json_string(use_diff))


class KeyeVL1_5Config(KeyeVLConfig):  # noqa: N801 - the official architecture spelling
    """:class:`KeyeVLConfig` of a Keye-VL-1.5 checkpoint (``model_type`` ``"KeyeVL1_5"``)."""

    model_type = MODEL_TYPE_V15
    _default_variant = "1.5"

    def __init__(self, *args: Any, **kwargs: Any):
        # Defined so that transformers' config machinery keeps KeyeVLConfig's constructor for this class.
        super().__init__(*args, **kwargs)


# PreTrainedConfig dataclass fields that pass through to the base class unchanged.
_BASE_FIELDS = ("output_hidden_states", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
                "id2label", "label2id", "problem_type", "output_attentions")
# Keys that mark a call with the flat file's layout rather than typed parts.
_FLAT_MARKERS = ("architectures", "model_type", "vision_config", "rope_scaling", *_TEXT_KEYS)
# Keyword arguments ``from_dict`` / ``from_pretrained`` may set on top of the file.
_OVERRIDABLE = ("attn_implementation", "torch_dtype", "projector_ln_eps", "variant", "text", "vision",
                *_TOKEN_KEYS)


def _dtype_name(value: Any) -> str | None:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bfloat16"`` -> ``"bfloat16"``; None stays None."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise KeyeConfigError(f"unknown torch_dtype {value!r}")
    return name


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


# This module imports transformers: finish the auto-class registration if it was waiting on us (keye/__init__).
import keye as _keye  # noqa: E402

_keye._register()
