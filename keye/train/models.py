"""Loading the models and processor a run needs, and moving weights between them.

Every part of a run that needs a model for inference (rollout engines, the evaluation copy, a reference model,
rollout workers) loads it through :func:`load_inference_model`, so its dtype, attention implementation, device and
frozen eval mode are set in one place; :func:`resolve_dtype` is where ``model.dtype: auto`` is decided.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from keye.errors import KeyeInputError
from keye.hub import resolve_model_path


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """``model.dtype`` as a torch dtype name: ``auto`` is bfloat16 on a GPU and float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return dtype


def load_processor(model: Any) -> Any:
    """The :class:`~keye.processing.processor.KeyeProcessor` of a ``model`` config section (its ``processor``
    directory, else its ``path``; ``keye-tiny`` and hub ids resolved)."""
    from keye.processing.processor import KeyeProcessor

    return KeyeProcessor.from_pretrained(resolve_model_path(model.processor or model.path))


def load_inference_model(path: Any, *, dtype: str, attn_implementation: str, device: torch.device | str) -> Any:
    """A :class:`~keye.model.keye_vl.KeyeVL` from ``path`` (a checkpoint directory, hub id or ``keye-tiny``) for
    inference: in ``dtype`` on ``device``, in eval mode, every parameter frozen."""
    from keye.model.keye_vl import KeyeVL

    model = KeyeVL.from_pretrained(resolve_model_path(path), torch_dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval().requires_grad_(False)


def load_weight_shards(model: torch.nn.Module, shards: Iterable[Mapping[str, torch.Tensor]]) -> int:
    """Copy weight shards ``{name: full tensor}`` into ``model`` shard by shard; every weight of the model
    must arrive exactly once. Returns the number of tensors loaded.

    Raises:
        KeyeInputError: an unknown name, a shape mismatch, a tensor sent twice or one never sent.
    """
    own = model.state_dict()
    seen: set[str] = set()
    with torch.no_grad():
        for shard in shards:
            for name, tensor in shard.items():
                if name not in own:
                    raise KeyeInputError(f"weight sync: {name!r} is not a weight of the rollout model")
                if tuple(tensor.shape) != tuple(own[name].shape):
                    raise KeyeInputError(f"weight sync: {name!r} has shape {tuple(tensor.shape)}, the rollout "
                                         f"model's is {tuple(own[name].shape)}")
                if name in seen:
                    raise KeyeInputError(f"weight sync: {name!r} was sent twice")
                own[name].copy_(tensor)
                seen.add(name)
    missing = sorted(set(own) - seen)
    if missing:
        raise KeyeInputError(f"weight sync: {len(missing)} weights never arrived, e.g. {missing[:3]}")
    return len(seen)


__all__ = ["load_inference_model", "load_processor", "load_weight_shards", "resolve_dtype"]
