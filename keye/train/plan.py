"""What both memory planners share: parameter counts from the real module shapes, the bytes per strategy of
parameters / gradients / AdamW states, the activations autograd saves in :mod:`keye.model`, plan items, and the
model config a planner reads.

``keye rl plan`` (:mod:`keye.rl.learner.plan`) and ``keye sft plan`` (:mod:`keye.sft.plan`) build their
per-GPU items from these. Every number is computed, none is looked up: parameter counts come from the model
built on the meta device, activation bytes from a per-layer count of the tensors autograd saves (see
``docs/rl_memory.md`` and ``docs/training.md`` "Planning memory" for the formulas). ``tests/rl/test_plan.py``
and ``tests/train/test_sft_plan.py`` check them against tensors measured on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keye.config import KeyeVLConfig
from keye.errors import KeyeConfigError

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4  # RMSNorm / RoPE / softmax statistics are kept in float32 whatever the model dtype

# Bytes kept per element by AdamW: exp_avg and exp_avg_sq, in the dtype of the parameter it updates.
ADAMW_STATES = 2

# Model configs bundled for offline planning of hub checkpoints: <repo root>/training/configs/models/<name>.json,
# where <name> is the hub model name lower-cased with '-' and '.' as '_' (Keye-VL-1_5-8B -> keye_vl_1_5_8b).
BUNDLED_CONFIGS = Path(__file__).resolve().parents[2] / "training" / "configs" / "models"


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of ``float32`` / ``bfloat16`` / ``float16`` (names or torch dtypes)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise KeyeConfigError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[name]


# ----------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one model, from its real module shapes.

    Attributes:
        shapes: ``(name, shape, trainable)`` of every unique parameter (a tied weight counted once).
        towers: parameters per tower (``vision``, ``projector``, ``llm``).
        decoder_layer / vision_layer: parameters of the largest decoder / vision encoder layer (FSDP2
            shards each of these as its own unit).
        root: parameters outside those layers (embeddings, ``lm_head``, final norms, projector, vision
            embeddings): FSDP2's root unit.
    """

    shapes: tuple[tuple[str, tuple[int, ...], bool], ...]
    towers: Mapping[str, int]
    decoder_layer: int
    vision_layer: int
    root: int
    root_trainable: int
    matmul: frozenset[str] = frozenset()  # parameters of nn.Linear / nn.Conv modules (what autocast casts)

    @property
    def total(self) -> int:
        """All unique parameters."""
        return sum(math.prod(s) for _, s, _ in self.shapes)

    @property
    def trainable(self) -> int:
        """Parameters that receive gradients and optimizer state."""
        return sum(math.prod(s) for _, s, t in self.shapes if t)

    def sharded(self, world_size: int, *, trainable_only: bool = False) -> int:
        """Elements one rank holds when every parameter is split on dim 0 into ``world_size`` equal chunks
        (FSDP2's layout: ``ceil(dim0 / world)`` rows per rank, the last ranks' chunks padded)."""
        if world_size < 1:
            raise KeyeConfigError(f"world_size must be >= 1, got {world_size}")
        n = 0
        for _, shape, trainable in self.shapes:
            if trainable_only and not trainable:
                continue
            rows = -(-shape[0] // world_size) if shape else 1
            n += rows * math.prod(shape[1:])
        return n

    def flat_sharded(self, world_size: int, *, trainable_only: bool = False) -> int:
        """Elements one rank holds when each parameter is flattened and split into ``world_size`` equal
        pieces (DeepSpeed ZeRO-3's partitions: ``ceil(numel / world)``)."""
        return sum(-(-math.prod(s) // world_size) for _, s, t in self.shapes if t or not trainable_only)


def count_parameters(config: KeyeVLConfig, frozen: Sequence[str] = ()) -> ParamCounts:
    """Count the parameters of ``KeyeVL(config)`` by building it on the meta device (no memory, exact shapes).

    Args:
        config: the model config (e.g. ``KeyeVLConfig.from_json_file("config.json")``).
        frozen: towers without gradients (``vision``, ``projector``, ``llm``), as ``train.stage`` sets them.
    """
    from keye.model.keye_vl import KeyeVL
    from keye.train.optim import TOWERS, tower_of

    bad = sorted(set(frozen) - set(TOWERS))
    if bad:
        raise KeyeConfigError(f"frozen has unknown tower(s) {bad}; use {sorted(TOWERS)}")
    with torch.device("meta"):
        model = KeyeVL(config)
    shapes, towers, seen = [], dict.fromkeys(TOWERS, 0), set()
    for name, p in model.named_parameters():  # named_parameters() yields a tied weight once
        if id(p) in seen:
            continue
        seen.add(id(p))
        tower = tower_of(name)
        towers[tower] += p.numel()
        shapes.append((name, tuple(p.shape), tower not in frozen))

    def unit(layers) -> int:
        return max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)

    matmul = frozenset(f"{mod_name}.{n}" if mod_name else n for mod_name, mod in model.named_modules()
                       if isinstance(mod, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d))
                       for n, _ in mod.named_parameters(recurse=False))
    in_layers = {id(p) for m in (model.model.layers, model.visual.vision_model.encoder.layers) for p in m.parameters()}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in in_layers]
    return ParamCounts(
        shapes=tuple(shapes),
        towers=towers,
        decoder_layer=unit(model.model.layers),
        vision_layer=unit(model.visual.vision_model.encoder.layers),
        root=sum(p.numel() for _, p in root),
        root_trainable=sum(p.numel() for n, p in root if tower_of(n) not in frozen),
        matmul=matmul,
    )


# ---------------------------------------------------------------------------------------- activations
def decoder_layer_bytes_per_token(config: KeyeVLConfig, dtype: str) -> int:
    """Bytes autograd saves per token in one decoder layer (``keye.model.text.DecoderLayer``, SDPA path).

    Two RMSNorms (float32 input, normalised value, the output the next Linear saves: ``4D + 2bD`` each, plus
    a float32 ``rsqrt`` per row), q and k through their per-head RMSNorm (float32 input + normalised value:
    ``(4 + b)(Q + K)``, RoPE's multiplications save only the shared cos/sin), the rotated q and the
    GQA-repeated k and v that SDPA saves with its output (``4bQ``, the output is also what ``o_proj`` saves:
    SDPA returns it in ``[B, L, H, d]`` layout) and the float32 log-sum-exp per head, and the SwiGLU MLP
    (gate, silu(gate), up, product: ``4bF``).
    """
    t, b = config.text, dtype_bytes(dtype)
    d, f, q, k = t.hidden_size, t.intermediate_size, t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    norms = 2 * (FP32 * d + 2 * b * d)
    rows = FP32 * (2 + t.num_attention_heads + t.num_key_value_heads)
    qk = (FP32 + b) * (q + k)
    attn = 4 * b * q + FP32 * t.num_attention_heads
    return norms + rows + qk + attn + 4 * b * f


def vision_layer_bytes_per_patch(config: KeyeVLConfig, dtype: str) -> int:
    """Bytes autograd saves per patch in one vision encoder layer (``keye.model.vision.VisionEncoderLayer``).

    Two LayerNorms (input + output, float32 mean / rstd: ``2bD + 8`` each), the three SDPA inputs gathered per
    segment group (``3bD`` and the int64 gather index; RoPE's multiplications save only the shared cos/sin),
    the attention output and the buffer ``out_proj`` saves (``2bD``) with the float32 log-sum-exp per head,
    and the MLP (fc1 output, GELU output: ``2bF``).
    """
    v, b = config.vision, dtype_bytes(dtype)
    d, f = v.hidden_size, v.intermediate_size
    return 2 * (2 * b * d + 2 * FP32) + 3 * b * d + 8 + 2 * b * d + FP32 * v.num_attention_heads + 2 * b * f


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch's forward + backward on one rank (see :func:`activation_bytes`)."""

    saved: int  # held from the end of the forward until the backward reaches each layer
    backward_peak: int  # the peak during the backward: saved + the largest recompute / gradient working set
    decoder_saved: int
    vision_saved: int
    mask_saved: int
    other_saved: int


def activation_bytes(config: KeyeVLConfig, *, dtype: str, tokens: int, sequences: int = 1, vision_patches: int = 0,
                     response_tokens: int | None = None, padded: bool = True,
                     gradient_checkpointing: bool = False, vision_frozen: bool = False,
                     amp: bool = False) -> Activations:
    """Activation memory of one training forward + backward (``KeyeVL.forward`` with the hidden states of
    ``response_tokens`` gathered for the chunked log-probs, as :func:`keye.train.logprobs.token_logprobs` does).

    Args:
        tokens: decoder tokens of the micro-batch (``sequences x`` padded length for padded batches).
        sequences: rows of the padded batch (the SDPA mask is ``[rows, 1, L, L]`` in the model dtype).
        vision_patches: patches through the vision tower (4 per merged visual token).
        response_tokens: tokens whose log-probs are taken (default: all ``tokens``).
        padded: the batch has padding, so SDPA receives (and saves) a dense mask per layer.
        gradient_checkpointing: each layer keeps only its input; the backward recomputes one layer at a time.
        vision_frozen: the vision tower has no trainable parameter, so it saves nothing (the projector still does).
        amp: float32 weights under bf16 autocast (``dtype`` bf16; the SFT recipe outside ZeRO). The residual streams
            are then float32: each RMSNorm / LayerNorm keeps its normalised value in float32 and every Linear
            that reads a norm's output saves its own bf16 cast of it (``+10D`` per token per decoder layer: q, k,
            v and gate, up; ``+8Dv`` per patch per vision layer), the text cos/sin are float32 (``+4 head_dim``),
            the gathered target rows float32 (``+2D`` each), a checkpointed layer keeps a float32 input, and the
            pixels arrive in float32 next to their bf16 cast.

    Without checkpointing every layer's saved tensors are alive at the end of the forward; with it, each
    layer keeps its input (``bD`` per token, ``bDv`` per patch) and one layer's full set is rebuilt during the
    backward. The backward peak adds the gradient buffers of one layer's backward: the residual stream's
    gradient in and out and two MLP-wide gradients (``2bD + 2bF`` per token, ``2bDv + 2bFv`` per patch; the
    MLP's saved inputs are released as its gradients appear, so no more are alive together).
    """
    if tokens < 0 or sequences < 1 or vision_patches < 0:
        raise KeyeConfigError(f"tokens, vision_patches must be >= 0 and sequences >= 1, got {tokens}, "
                              f"{vision_patches}, {sequences}")
    t, v, b = config.text, config.vision, dtype_bytes(dtype)
    resp = tokens if response_tokens is None else response_tokens
    length = -(-tokens // sequences)
    amp = amp and b == 2
    dec_layer = (decoder_layer_bytes_per_token(config, dtype) + (10 * t.hidden_size if amp else 0)) * tokens
    vis_layer = (vision_layer_bytes_per_patch(config, dtype) + (8 * v.hidden_size if amp else 0)) * vision_patches
    mask_layer = sequences * length * length * b if padded else 0
    # once per forward: token ids (int64) and the placeholder mask of the embedding, cos/sin, final norm and its
    # output (kept by the hidden states), the gathered response rows; vision: pixels, float32 cos/sin, the
    # post-layernorm and the projector (pre-norm input + output, linear_1 output, GELU output per merged token)
    per_token = 8 + 1 + 2 * (FP32 if amp else b) * t.head_dim + (FP32 + 2 * b) * t.hidden_size + FP32
    m2 = v.spatial_merge_size**2
    per_patch = 4 * b * v.hidden_size + (2 * FP32) / m2
    if vision_frozen:
        vis_layer = 0
    else:
        per_patch += b * v.num_channels * v.patch_size**2 + 2 * FP32 * v.head_dim + b * v.hidden_size + 2 * FP32
    if amp:  # the loader's float32 pixels, of which the patch embedding saves the bf16 cast
        per_patch += FP32 * v.num_channels * v.patch_size**2
    other = int(per_token * tokens + (FP32 if amp else b) * t.hidden_size * resp + per_patch * vision_patches)
    n_dec, n_vis = t.num_hidden_layers, v.num_hidden_layers
    grads = (2 * b * t.hidden_size + 2 * b * t.intermediate_size) * tokens
    if not vision_frozen:
        grads += (2 * b * v.hidden_size + 2 * b * v.intermediate_size) * vision_patches
    if amp:  # the residual streams' gradients are float32 too
        grads += 2 * (FP32 - b) * (t.hidden_size * tokens + (0 if vision_frozen else v.hidden_size * vision_patches))
    if gradient_checkpointing:
        rb = FP32 if amp else b  # the residual stream a checkpointed layer keeps as its input
        dec = n_dec * rb * t.hidden_size * tokens
        vis = 0 if vision_frozen else n_vis * rb * v.hidden_size * vision_patches
        saved = dec + vis + other
        recompute = max(dec_layer + mask_layer, vis_layer)
        return Activations(saved=saved, backward_peak=saved + recompute + grads, decoder_saved=dec,
                           vision_saved=vis, mask_saved=0, other_saved=other)
    dec, vis, mask = n_dec * dec_layer, n_vis * vis_layer, n_dec * mask_layer
    saved = dec + vis + mask + other
    return Activations(saved=saved, backward_peak=saved + grads, decoder_saved=dec, vision_saved=vis,
                       mask_saved=mask, other_saved=other)



# ------------------------------------------------------------------------------------------------ items
@dataclass
class Item:
    """One line of the plan: ``bytes`` on one GPU, in ``phase`` (a phase name of the plan that lists it)."""

    name: str
    bytes: int
    phase: str
    note: str = ""



class Items:
    """A plan's items as they are added (GPU items, and host memory items)."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.host: list[Item] = []

    def add(self, name: str, n: int, phase: str, note: str = "") -> int:
        """Append a GPU item of ``n`` bytes; returns ``n`` (so totals can be summed as items are added)."""
        self.items.append(Item(name, int(n), phase, note))
        return int(n)


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raise :class:`KeyeConfigError` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise KeyeConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


# ---------------------------------------------------------------------------------------- model config
def _bundled_name(model_path: str) -> str:
    return model_path.rstrip("/").split("/")[-1].lower().replace("-", "_").replace(".", "_")


def resolve_model_config(model_path: str, explicit: str | None = None) -> tuple[KeyeVLConfig, str]:
    """The :class:`~keye.config.KeyeVLConfig` to plan for, and the name to report.

    In order: ``explicit`` (a config.json or its directory); ``model_path`` as a local checkpoint directory
    (``keye-tiny`` included); the bundled ``training/configs/models/<name>.json`` of a hub id; the
    config.json of a hub id already in the local Hugging Face cache. Nothing is downloaded.

    Raises:
        KeyeConfigError: none of these has a config (the message names the bundled file it looked for).
    """
    from keye.tiny import resolve_model_path

    if explicit:
        return KeyeVLConfig.from_json_file(explicit), str(explicit)
    local = Path(resolve_model_path(model_path))
    if local.exists():
        return KeyeVLConfig.from_json_file(local), str(model_path)
    bundled = BUNDLED_CONFIGS / f"{_bundled_name(model_path)}.json"
    if bundled.is_file():
        return KeyeVLConfig.from_json_file(bundled), str(model_path)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json")
    except Exception:  # noqa: BLE001 - an invalid repo id or no hub client: same as "not cached"
        cached = None
    if isinstance(cached, str):
        return KeyeVLConfig.from_json_file(cached), str(model_path)
    raise KeyeConfigError(
        f"model.path {model_path!r}: no local directory, no bundled config ({bundled.name} in "
        f"training/configs/models) and no cached config.json; pass --model-config CONFIG_JSON"
    )


__all__ = ["ADAMW_STATES", "BUNDLED_CONFIGS", "DTYPE_BYTES", "FP32", "GiB", "Activations", "Item", "Items",
           "ParamCounts", "activation_bytes", "check_choice", "count_parameters", "decoder_layer_bytes_per_token",
           "dtype_bytes", "resolve_model_config", "vision_layer_bytes_per_patch"]
