"""Registration of Keye-VL with transformers' auto classes (done when ``keye`` is imported).

After ``import keye``, ``AutoConfig``, ``AutoModel``, ``AutoModelForImageTextToText``,
``AutoModelForCausalLM`` and ``AutoProcessor`` know both official model types (``"Keye"`` for
Keye-VL-8B-Preview, ``"KeyeVL1_5"`` for Keye-VL-1.5), so ``from_pretrained`` on an official or
keye-saved checkpoint returns Keye's classes. The registered classes are local code, so transformers
uses them instead of the checkpoint's ``auto_map`` remote code (no ``trust_remote_code`` needed).
"""

from __future__ import annotations


def register_auto_classes() -> None:
    """Register Keye's config, model and processor classes with transformers (idempotent)."""
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
    )

    from keye.config import MODEL_TYPE_PREVIEW, MODEL_TYPE_V15, KeyeVL1_5Config, KeyeVLConfig
    from keye.model.keye_vl import KeyeVL, KeyeVL1_5ForConditionalGeneration
    from keye.processing.processor import KeyeProcessor, KeyeVL1_5Processor

    AutoConfig.register(MODEL_TYPE_PREVIEW, KeyeVLConfig, exist_ok=True)
    AutoConfig.register(MODEL_TYPE_V15, KeyeVL1_5Config, exist_ok=True)
    for auto in (AutoModel, AutoModelForImageTextToText, AutoModelForCausalLM):
        auto.register(KeyeVLConfig, KeyeVL, exist_ok=True)
        auto.register(KeyeVL1_5Config, KeyeVL1_5ForConditionalGeneration, exist_ok=True)
    AutoProcessor.register(KeyeVLConfig, KeyeProcessor, exist_ok=True)
    AutoProcessor.register(KeyeVL1_5Config, KeyeVL1_5Processor, exist_ok=True)
