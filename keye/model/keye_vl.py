"""KeyeVL: vision tower + projector + Qwen3 decoder, with loading, saving, loss and generation.

Parameter names are exactly the official checkpoints' (``visual.vision_model.*``, ``mlp_AR.*``,
``model.*``, ``lm_head.weight``), so the official Keye-VL-8B-Preview and Keye-VL-1.5-8B files load
unchanged and ``save_pretrained`` output loads back in the official code and in vLLM.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig as HFGenerationConfig
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from keye.config import KeyeVL1_5Config, KeyeVLConfig
from keye.errors import KeyeConfigError, KeyeInputError, KeyeWeightsError
from keye.model.attention import check_backend
from keye.model.generation import GenerationConfig, iter_text, select_next_tokens
from keye.model.projector import Projector
from keye.model.rope import get_rope_index, mrope_cos_sin, split_video_grid, text_inv_freq
from keye.model.text import KVCache, TextModel
from keye.model.vision import KeyeVisionModel
from keye.model.weights import is_ignored_key, iter_tensors, resolve_checkpoint, save_state_dict

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, config: KeyeVLConfig) -> torch.dtype:
    """``"auto"`` -> the checkpoint's ``torch_dtype`` (float32 if unset); strings -> torch dtypes."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return _DTYPES.get(str(config.torch_dtype), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


@dataclass
class KeyeOutput(ModelOutput):
    """Result of :meth:`KeyeVL.forward` (a transformers ``ModelOutput``).

    logits: [B, L', vocab] (L' = L, or ``logits_to_keep`` last positions); None with a ``logprob_request``, and
        with a ``loss_request`` unless ``logits_to_keep`` asks for the last positions.
    loss: mean (or summed, see ``loss_reduction``) cross entropy over target tokens, if labels (or a
        ``loss_request``) given.
    num_target_tokens: number of label tokens != -100 that entered the loss (a weighted ``loss_request``: the
        weights' sum).
    rope_deltas: [B, 1] offsets for decoding positions (prefill only).
    position_ids: [3, B, L] positions used.
    cache (also readable as ``past_key_values``): the KV cache when ``use_cache`` (a :class:`KVCache`,
        or the transformers ``Cache`` that was passed in).
    hidden_states: final normed hidden states [B, L, D] when ``output_hidden_states``.
    token_logp / token_entropy: results of a ``logprob_request`` (float32 [K] / [U] or None).
    """

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    num_target_tokens: int | float | None = None
    rope_deltas: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cache: Any = None
    hidden_states: torch.Tensor | None = None
    token_logp: torch.Tensor | None = None
    token_entropy: torch.Tensor | None = None

    @property
    def past_key_values(self) -> Any:
        """The KV cache (``cache``) under its older name."""
        return self.cache

    def __getitem__(self, key: str | int | slice) -> Any:
        # Unset fields read as None by name (as before this was a ModelOutput), not as KeyError.
        return getattr(self, key) if isinstance(key, str) else super().__getitem__(key)


# Model inputs that only the prefill reads (the vision features then live in the KV cache).
_VISION_KWARGS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                  "num_frames")
# Keyword arguments Keye's own decoding loop understands (its GenerationConfig fields and model inputs).
_KEYE_LOOP_KWARGS = frozenset(GenerationConfig.__dataclass_fields__) | frozenset(_VISION_KWARGS) | {"labels"}


def _check_decoding_args(kwargs: dict[str, Any]) -> None:
    """Reject out-of-range decoding settings with a ValueError naming them, whichever loop runs
    (transformers only checks some of them, and only when they are used)."""
    checks = (
        ("max_new_tokens", lambda v: v >= 0, "must be >= 0"),
        ("temperature", lambda v: v > 0 or not kwargs.get("do_sample"), "must be > 0 when sampling"),
        ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]"),
        ("top_k", lambda v: v >= 0, "must be >= 0"),
        ("repetition_penalty", lambda v: v > 0, "must be > 0"),
    )
    for name, ok, rule in checks:
        value = kwargs.get(name)
        if value is not None and not ok(value):
            raise ValueError(f"{name} {rule}, got {value}")


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    """Names of the keyword arguments ``cls.forward`` accepts."""
    return frozenset(inspect.signature(cls.forward).parameters) - {"self"}


def cache_length(cache: Cache | KVCache | None) -> int:
    """Number of positions already held by a KV cache (0 for None)."""
    if cache is None:
        return 0
    return cache.length if isinstance(cache, KVCache) else cache.get_seq_length()


def shifted_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """int [B, L - 1]: the target of each predicting position, ``labels[:, t + 1]`` (-100: no loss); in a packed
    row (``cu_seqlens`` [n + 1]) no sample's last token predicts the next sample's first (-100 there)."""
    shift = labels[:, 1:].clone()
    if cu_seqlens is not None:
        ends = cu_seqlens[1:-1].long() - 1  # last token of each sample but the final one
        shift[0, ends.to(shift.device)] = -100
    return shift


def _reduce_loss(total: torch.Tensor, n_target: float, reduction: str) -> torch.Tensor:
    """A summed token loss as ``reduction`` asks: "sum" as is, "mean" over the ``n_target`` targets."""
    if reduction == "mean":
        return total / max(n_target, 1)
    if reduction != "sum":
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {reduction!r}")
    return total


def _target_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str,
                 label_smoothing: float = 0.0) -> tuple[torch.Tensor, int]:
    """``(loss, target count)`` of the cross entropy of ``logits`` [B, L, V] against ``targets`` [B, T] (T <= L,
    position t predicts ``targets[:, t]``, -100: none; the next-token targets are :func:`shifted_targets`), in
    float32. ``reduction``: "mean" over the targets or "sum". The reference the chunked loss (``loss_request``,
    :mod:`keye.train.loss`) is checked against."""
    shift_logits = logits[:, : targets.shape[1]].float()
    n_target = int((targets != -100).sum())
    loss = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        targets.reshape(-1).to(shift_logits.device),
        ignore_index=-100,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return _reduce_loss(loss, n_target, reduction), n_target


class KeyeVL(PreTrainedModel, GenerationMixin):
    """The Keye-VL model (both the 8B-Preview and the 1.5 variants, chosen by ``config.variant``).

    A transformers ``PreTrainedModel`` with ``GenerationMixin``: ``generate`` is transformers' own (greedy,
    sampling, beam search, streamers, stopping criteria, logits processors, stop strings, ...), with the
    3-D mRoPE positions carried through the decoding steps and vision inputs read at prefill only.

    Children (= checkpoint prefixes): ``visual`` (SigLIP tower), ``mlp_AR`` (projector), ``model``
    (Qwen3 decoder) and ``lm_head``.
    """

    config_class = KeyeVLConfig
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer", "VisionEncoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True
    _supports_flash_attn = True

    def __init__(self, config: KeyeVLConfig):
        super().__init__(config)
        self.visual = KeyeVisionModel(config.vision)
        self.mlp_AR = Projector(config)
        self.model = TextModel(config.text)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.text.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.set_attn_implementation(config.attn_implementation)
        self.post_init()
        self.generation_config = self._default_generation_config(self.generation_config)

    def _init_weights(self, module: nn.Module) -> None:
        """Leave the weights as the modules' own constructors made them.

        Every module is freshly built by PyTorch (or on the meta device, then loaded), so transformers'
        generic re-initialisation pass has nothing to add; skipping it keeps the random streams of
        ``KeyeVL(config)`` exactly what they were before this became a ``PreTrainedModel``.
        """
        del module

    def _default_generation_config(self, gen: HFGenerationConfig | None) -> HFGenerationConfig:
        """transformers' generation defaults, completed with Keye's: EOS from the config, PAD = the config's
        pad (else BOS, else 0) and at most 256 new tokens when the checkpoint's ``generation_config.json``
        sets no length. (No top-k unless asked for: see :meth:`generate`.)"""
        gen = gen if gen is not None else HFGenerationConfig()
        c = self.config
        if gen.eos_token_id is None and c.eos_token_ids:
            gen.eos_token_id = c.eos_token_ids if len(c.eos_token_ids) > 1 else c.eos_token_ids[0]
        if gen.pad_token_id is None:
            gen.pad_token_id = c.pad_token_id if c.pad_token_id is not None else (
                c.bos_token_id if c.bos_token_id is not None else 0
            )
        if gen.bos_token_id is None:
            gen.bos_token_id = c.bos_token_id
        if gen.max_length is None and gen.max_new_tokens is None:
            gen.max_new_tokens = 256
        return gen

    # ------------------------------------------------------------------------------ switches
    def _check_and_adjust_attn_implementation(self, attn_implementation, is_init_check=False, allow_all_kernels=False):
        """transformers' hook for validating the backend: Keye's own three backends, checked by
        :func:`keye.model.attention.check_backend` (a clear :class:`KeyeConfigError` otherwise)."""
        del is_init_check, allow_all_kernels
        name = attn_implementation or "sdpa"
        check_backend(name)
        return name

    def set_attn_implementation(self, name: str, allow_all_kernels: bool = False) -> None:
        """Switch every attention layer to ``sdpa``, ``eager`` or ``flash_attention_2``."""
        del allow_all_kernels
        check_backend(name)
        self.config.attn_implementation = name
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = name

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Recompute decoder and vision layers in backward (less activation memory, ~30% more compute)."""
        del gradient_checkpointing_kwargs
        self.model.gradient_checkpointing = True
        self.visual.vision_model.encoder.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        """Undo :meth:`gradient_checkpointing_enable`."""
        self.model.gradient_checkpointing = False
        self.visual.vision_model.encoder.gradient_checkpointing = False

    @property
    def device(self) -> torch.device:
        """Device of the output head (where logits come out)."""
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the output head's weight."""
        return self.lm_head.weight.dtype

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding table (``model.embed_tokens``)."""
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        """Replace the token embedding table."""
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        """The output head (``lm_head``)."""
        return self.lm_head

    # -------------------------------------------------------------------------------- vision
    def _vision_items(self, pixel_values, grid_thw, is_video: bool, kind: str) -> list[tuple[int, int, int]]:
        """Validated per-item grids of one modality (1.5 videos split into per-frame items)."""
        if grid_thw is None:
            raise KeyeInputError(f"{kind} pixel values were given without their grid_thw")
        if is_video and self.config.variant == "1.5":
            grids = split_video_grid(grid_thw)
        else:
            grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        m = self.config.vision.spatial_merge_size
        for t, h, w in grids:
            if h % m or w % m:
                raise KeyeInputError(f"{kind} grid {[t, h, w]} is not divisible by the merge size {m}")
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != n:
            raise KeyeInputError(
                f"{kind} pixel rows ({pixel_values.shape[0]}) do not match the grids ({n} patches from "
                f"{len(grids)} items)"
            )
        return grids

    def encode_vision(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, *, is_video: bool = False
    ) -> torch.Tensor:
        """Tower + projector for one modality.

        Args:
            pixel_values: [sum(t*h*w), 3, p, p].
            grid_thw: int [n_items, 3] in patch units (1.5 videos: merged per-frame rows are fine).
            is_video: preview videos attend across all their frames (one segment per video);
                1.5 videos attend per frame.
        Returns:
            [sum(t*h*w)/4, hidden], merged tokens in placeholder order.
        """
        grids = self._vision_items(pixel_values, grid_thw, is_video, "video" if is_video else "image")
        return self.mlp_AR(self.visual(pixel_values, grids), grids)

    def _scatter(self, embeds, input_ids, token_id, feats, kind):
        mask = input_ids == token_id
        n_tok = int(mask.sum())
        if n_tok != feats.shape[0]:
            raise KeyeInputError(
                f"{kind} features and placeholders differ: {n_tok} <|{kind}_pad|> tokens in input_ids but "
                f"{feats.shape[0]} {kind} features from the pixel inputs"
            )
        return embeds.masked_scatter(mask[..., None], feats.to(embeds.dtype))

    def embed(
        self, input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
        vision_split: Any = None,
    ) -> torch.Tensor:
        """Token embeddings with image/video features written into their placeholder slots.

        Images and videos go through the tower in **one** packed call (attention stays block-diagonal
        per item, so this equals separate calls). With ``always_run_vision`` set (done by the recipes for
        DDP/FSDP/ZeRO), a batch without pixels still runs the tower on one dummy item whose output is added
        with weight 0 - in training, and in evaluation too when ``collective_forward`` is also set (sharded
        weights: every forward gathers them collectively): every rank then runs the same modules in the same
        order.

        ``vision_split`` (the forward's ``context_parallel``): an object whose
        ``encode_vision(encode, pixels, grids, merge_size)`` runs ``encode`` (tower + projector) on its share of the
        items and returns every item's features in order (split over a group of ranks, gathered with a backward).
        """
        embeds = self.model.embed_tokens(input_ids)
        for pix, tok, kind in ((pixel_values, self.config.image_token_id, "image"),
                               (pixel_values_videos, self.config.video_token_id, "video")):
            if pix is None and bool((input_ids == tok).any()):
                name = "pixel_values" if kind == "image" else "pixel_values_videos"
                raise KeyeInputError(f"input_ids contain <|{kind}_pad|> placeholders but no {name} were given")
        pieces, grids, counts = [], [], []
        if pixel_values is not None:
            g = self._vision_items(pixel_values, image_grid_thw, False, "image")
            pieces.append(pixel_values)
            grids += g
            counts.append(("image", len(g)))
        if pixel_values_videos is not None:
            g = self._vision_items(pixel_values_videos, video_grid_thw, True, "video")
            pieces.append(pixel_values_videos)
            grids += g
            counts.append(("video", len(g)))
        if not pieces:
            if getattr(self, "always_run_vision", False) and (self.training or getattr(self, "collective_forward", False)):
                m = self.config.vision.spatial_merge_size
                p = self.config.vision.patch_size
                dummy = torch.zeros(m * m, self.config.vision.num_channels, p, p, device=embeds.device)
                feats = self.mlp_AR(self.visual(dummy, [(1, m, m)]), [(1, m, m)])
                embeds = embeds + 0.0 * feats.sum().to(embeds.dtype)
            return embeds
        pixels = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if vision_split is None:
            feats = self.mlp_AR(self.visual(pixels, grids), grids)
        else:
            feats = vision_split.encode_vision(lambda pix, g: self.mlp_AR(self.visual(pix, g), g), pixels, grids,
                                               self.config.vision.spatial_merge_size)
        m2 = self.config.vision.spatial_merge_size ** 2
        start = 0
        for kind, n_items in counts:
            items = grids[:n_items]
            grids = grids[n_items:]
            n_tok = sum(t * h * w for t, h, w in items) // m2
            tok = self.config.image_token_id if kind == "image" else self.config.video_token_id
            embeds = self._scatter(embeds, input_ids, tok, feats[start : start + n_tok], kind)
            start += n_tok
        return embeds

    # ------------------------------------------------------------------------------ positions
    def get_rope_index(
        self, input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
        seq_lens: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """3-D positions [3, B, L] and rope deltas [B, 1]; see :func:`keye.model.rope.get_rope_index`."""
        c = self.config
        return get_rope_index(
            input_ids,
            image_token_id=c.image_token_id,
            video_token_id=c.video_token_id,
            spatial_merge_size=c.vision.spatial_merge_size,
            variant=c.variant,
            tokens_per_second=c.vision.tokens_per_second,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
            attention_mask=attention_mask,
            seq_lens=seq_lens,
        )

    # -------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: KVCache | None = None, use_cache: bool = False,
        rope_deltas: torch.Tensor | None = None,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        num_frames: torch.Tensor | None = None,
        logits_to_keep: int = 0, loss_reduction: str = "mean",
        output_hidden_states: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        attention_override=None,
        cache: Cache | KVCache | None = None, return_dict: bool | None = None,
        logprob_request: Any = None,
        text_token_mask: torch.Tensor | None = None,
        loss_request: Any = None,
        label_smoothing: float = 0.0,
        context_parallel: Any = None,
    ) -> KeyeOutput:
        """One forward pass.

        Args:
            input_ids: int [B, L], placeholders expanded (the processor's output).
            attention_mask: int [B, L], 0 on left padding (and, with a cache, over past + new tokens).
            position_ids: int [3, B, L]; computed from the ids and grids when omitted.
            pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw: vision inputs
                (only read at prefill, i.e. when the cache is empty).
            second_per_grid_ts: float [n_videos] (preview videos' time positions).
            labels: int [B, L] with -100 where no loss; shifted inside (token t predicts t+1).
            past_key_values / use_cache: pass a :class:`KVCache` (or ``use_cache=True`` to create one).
            rope_deltas: [B, 1] from the prefill, used for decoding positions.
            seq_lens: packed training: B = 1 and the row is several samples of these lengths; every
                sample gets its own positions and causal attention, no attention crosses samples, and
                no loss term predicts a token of the next sample.
            num_frames: accepted for compatibility with the official 1.5 interface (unused; the
                frame count is implied by video_grid_thw).
            logits_to_keep: > 0 computes logits for the last n positions only.
            loss_reduction: ``"mean"`` over target tokens or ``"sum"`` (for normalising by a global
                token count across micro-batches and ranks).
            attention_override: a callable ``f(q, k, v, *, layer_idx, scale) -> out`` replacing the
                decoder's attention (q [B, Hq, L, d], k/v [B, Hkv, L, d] after q/k norm and RoPE; out
                like q). Used for custom patterns such as shared-prefix tree batches; pass explicit
                ``position_ids`` with it.
            cache: transformers' name for ``past_key_values`` (what ``generate`` passes); either a
                :class:`KVCache` or a transformers ``Cache`` (``DynamicCache``, ``StaticCache``, ...).
            return_dict: accepted for transformers compatibility; the result is always a :class:`KeyeOutput`.
            logprob_request: a :class:`keye.train.logprobs.LogprobRequest`: per-token log-probs (and entropies)
                of chosen hidden positions computed here, chunk by chunk, instead of full logits
                (``logits`` is then None, results in ``token_logp`` / ``token_entropy``). Inside the
                forward because sharded training (FSDP2, ZeRO-3) only materialises ``lm_head`` there.
            text_token_mask: bool [B, L]: positions whose id is an image/video placeholder but that were
                *sampled* as text (a rollout that emitted ``<|image_pad|>``): they get their own token
                embedding and ordinary text positions, as during decoding.
            loss_request: a :class:`keye.train.loss.LossRequest`: the loss computed chunk by chunk over the target
                positions only (recomputed in backward), never the full [B, L, V] logits; ``logits`` is then None
                (or the last ``logits_to_keep`` positions). Values and gradients equal the full path's. Inside the
                forward for the same reason as ``logprob_request``.
            label_smoothing: the cross entropy's label smoothing (as ``F.cross_entropy``'s), on either path.
            context_parallel: a :class:`keye.train.context_parallel.ContextParallel` (packed rows only): every rank
                of its group passes the same whole row; the vision items are encoded split over the group, the
                decoder runs on this rank's slice of the row (attention all-to-all over heads, packed-sample
                boundaries and 3-D positions those of the whole row) and ``loss`` / ``num_target_tokens`` /
                ``hidden_states`` / ``logits`` / ``position_ids`` are this rank's slice's (sum the losses over the
                group; ``loss_reduction="sum"``).
        """
        del num_frames, return_dict
        cache = self._forward_cache(cache, past_key_values, use_cache)
        past = cache_length(cache)
        if input_ids is None and inputs_embeds is None:
            raise KeyeInputError("forward needs input_ids or inputs_embeds")
        packed = seq_lens is not None
        if packed:
            seq_lens = [int(x) for x in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
            if cache is not None:
                raise KeyeInputError("packed sequences (seq_lens) cannot be used with a KV cache")
        if context_parallel is not None and (not packed or attention_override is not None or logprob_request is not None):
            raise KeyeInputError("context_parallel needs a packed row (seq_lens) and neither attention_override nor "
                                 "logprob_request")

        pos_ids = input_ids
        if text_token_mask is not None and input_ids is not None and bool(text_token_mask.any()):
            # any non-placeholder id: only "is it vision" matters for positions and the feature scatter
            pos_ids = input_ids.masked_fill(text_token_mask.to(input_ids.device), 0)
        if inputs_embeds is None:
            inputs_embeds = self._forward_embeds(input_ids, pos_ids, text_token_mask, past, pixel_values,
                                                 image_grid_thw, pixel_values_videos, video_grid_thw, context_parallel)
        if position_ids is None:
            position_ids, rope_deltas = self._forward_positions(
                pos_ids, inputs_embeds, past, rope_deltas, image_grid_thw, video_grid_thw, second_per_grid_ts,
                None if packed else attention_mask, seq_lens if packed else None,
            )
        cu_seqlens = None
        if packed:
            cu_seqlens = torch.tensor([0, *seq_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
        targets = None  # aligned with the hidden states: position t predicts targets[:, t]
        if context_parallel is not None:
            # this rank's slice of the row; the override attends over the whole row's samples
            full_targets = shifted_targets(labels, cu_seqlens) if labels is not None else None
            inputs_embeds, position_ids, targets, attention_override = context_parallel.split_row(
                inputs_embeds, position_ids, full_targets, cu_seqlens, self.model.layers[0].self_attn.backend)
            attention_mask = cu_seqlens = None
        elif labels is not None:
            targets = shifted_targets(labels, cu_seqlens)
        inv_freq = text_inv_freq(self.config.text.head_dim, self.config.text.rope_theta, device=inputs_embeds.device)
        cos, sin = mrope_cos_sin(position_ids, inv_freq, self.config.text.mrope_section, inputs_embeds.dtype)

        key_mask = attention_mask
        if key_mask is not None and cache is None and bool(key_mask.all()):
            key_mask = None
        hidden = self.model(inputs_embeds, cos, sin, key_mask, cache, cu_seqlens, attention_override)

        if logprob_request is not None and loss_request is not None:
            raise KeyeInputError("pass either logprob_request or loss_request, not both")
        token_logp = token_entropy = logits = None
        if logprob_request is not None:
            token_logp, token_entropy = logprob_request.compute(hidden, self.lm_head)
        elif loss_request is None or logits_to_keep > 0:
            # with a loss_request the full logits are exactly what must not be materialised
            logits = self.lm_head(hidden if logits_to_keep <= 0 else hidden[:, -logits_to_keep:])
        loss = n_target = None
        if loss_request is not None:
            total, n_target = loss_request.compute(hidden, self.lm_head, targets, label_smoothing)
            loss = _reduce_loss(total, n_target, loss_reduction)
        elif labels is not None:
            full_logits = logits if logits is not None and logits_to_keep <= 0 else self.lm_head(hidden)
            loss, n_target = _target_loss(full_logits, targets, loss_reduction, label_smoothing)
        return KeyeOutput(
            logits=logits, loss=loss, num_target_tokens=n_target, rope_deltas=rope_deltas,
            position_ids=position_ids, cache=cache, hidden_states=hidden if output_hidden_states else None,
            token_logp=token_logp, token_entropy=token_entropy,
        )

    def _forward_cache(self, cache: Any, past_key_values: Any, use_cache: bool) -> Any:
        """The KV cache of a forward call: ``cache`` (transformers' name) or ``past_key_values``, a new
        :class:`KVCache` when ``use_cache`` asks for one and none is given, else None."""
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise KeyeInputError("pass the KV cache either as past_key_values or as cache, not both")
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = KVCache(len(self.model.layers))
        return cache

    def _forward_embeds(self, input_ids, pos_ids, text_token_mask, past, pixel_values, image_grid_thw,
                        pixel_values_videos, video_grid_thw, vision_split=None) -> torch.Tensor:
        """Input embeddings: at prefill (``past == 0``) text and vision features merged (``pos_ids``: the ids
        with placeholders sampled as text masked off), positions in ``text_token_mask`` embedded as the
        tokens they are; while decoding the token embeddings alone."""
        if past != 0:
            return self.model.embed_tokens(input_ids)
        embeds = self.embed(pos_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, vision_split)
        if pos_ids is not input_ids:
            raw = self.model.embed_tokens(input_ids)
            embeds = torch.where(text_token_mask.to(raw.device)[..., None], raw, embeds)
        return embeds

    def _forward_positions(self, pos_ids, inputs_embeds, past, rope_deltas, image_grid_thw, video_grid_thw,
                           second_per_grid_ts, attention_mask, seq_lens):
        """``(position_ids [3, B, L], rope_deltas)`` when the caller gave no positions: the 3-D rope index at
        prefill, else the next ``L`` steps after ``past`` shifted by the prefill's ``rope_deltas``."""
        if past == 0 and pos_ids is not None:
            return self.get_rope_index(pos_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                       attention_mask, seq_lens)
        bsz, seq = inputs_embeds.shape[:2]
        dev = inputs_embeds.device
        if rope_deltas is None:
            rope_deltas = torch.zeros(bsz, 1, dtype=torch.long, device=dev)
        step = torch.arange(past, past + seq, device=dev)[None, :] + rope_deltas.to(dev)
        return step[None].expand(3, -1, -1), rope_deltas

    # ----------------------------------------------------------------------------- generation
    def _generation_config(self, **kwargs: Any) -> GenerationConfig:
        cfg = GenerationConfig(**kwargs)
        if cfg.eos_token_id is None:
            cfg.eos_token_id = self.config.eos_token_ids or None
        if cfg.pad_token_id is None:
            cfg.pad_token_id = self.config.pad_token_id if self.config.pad_token_id is not None else (
                self.config.bos_token_id if self.config.bos_token_id is not None else 0
            )
        cfg.validate()
        return cfg

    @torch.no_grad()
    def generate_steps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        num_frames: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **gen_kwargs: Any,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Decode with the KV cache, yielding ``(next_tokens [B], step_logits [B, V])`` per step.

        Rows that already produced an EOS get ``pad_token_id``; the loop ends when every row has
        finished or after ``max_new_tokens`` steps. ``gen_kwargs`` are :class:`GenerationConfig` fields.
        """
        del num_frames, labels
        cfg = self._generation_config(**gen_kwargs)
        bsz, prompt_len = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        cache = KVCache(len(self.model.layers), capacity=prompt_len + cfg.max_new_tokens)
        eos = torch.tensor(cfg.eos_ids, dtype=torch.long, device=input_ids.device)
        finished = torch.zeros(bsz, dtype=torch.bool, device=input_ids.device)
        sequences = input_ids
        out = self(
            input_ids, attention_mask=attention_mask, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
            pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts, past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        rope_deltas = out.rope_deltas
        for _ in range(cfg.max_new_tokens):
            step_logits = out.logits[:, -1].float()
            nxt = select_next_tokens(step_logits, sequences, cfg, generator)
            nxt = torch.where(finished, torch.full_like(nxt, cfg.pad_token_id), nxt)
            yield nxt, step_logits
            if eos.numel():
                finished = finished | torch.isin(nxt, eos)
            if bool(finished.all()):
                return
            sequences = torch.cat([sequences, nxt[:, None]], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
            out = self(
                nxt[:, None], attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                rope_deltas=rope_deltas,
            )

    # ----------------------------------------------------- transformers generation (GenerationMixin)
    def _prepare_position_ids_for_generation(self, inputs_tensor, model_kwargs):
        """3-D mRoPE positions [3, B, L] of the prompt; ``generate`` then extends them per step
        (:meth:`_update_model_kwargs_for_generation`) and slices them for each forward."""
        ids = model_kwargs.get("input_ids")
        if ids is None or ids.shape[1] == 0:
            ids = inputs_tensor
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            # A prompt given as inputs_embeds: plain text positions on all three axes.
            text = super()._prepare_position_ids_for_generation(inputs_tensor, model_kwargs)
            return text[None].expand(3, -1, -1)
        positions, _ = self.get_rope_index(
            ids, model_kwargs.get("image_grid_thw"), model_kwargs.get("video_grid_thw"),
            model_kwargs.get("second_per_grid_ts"), model_kwargs.get("attention_mask"),
        )
        return positions

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
        """transformers' bookkeeping (cache, attention mask), with mRoPE decoding positions: every new
        token takes ``1 + the largest id so far`` on all three axes, i.e. ``position + rope_delta``."""
        positions = model_kwargs.pop("position_ids", None)
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )
        if positions is not None:
            # The last real token carries the largest id of its row (left padding keeps it last).
            last = positions[..., -1:].amax(dim=0, keepdim=True)
            step = torch.arange(1, num_new_tokens + 1, dtype=positions.dtype, device=positions.device)
            model_kwargs["position_ids"] = torch.cat([positions, (last + step).expand(3, -1, -1)], dim=-1)
        return model_kwargs

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        next_sequence_length: int | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """transformers' input preparation; vision inputs (pixels, grids, frame times) reach the model at
        prefill only: once the cache holds the prompt, their features are already in it."""
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs,
        )
        if not is_first_iteration and cache_length(cache) > 0:
            for key in _VISION_KWARGS:
                inputs.pop(key, None)
        # generate() routes its mode arguments (e.g. stop_strings' tokenizer) through the model kwargs;
        # the user's own model kwargs were validated against forward() before decoding started.
        accepted = _forward_parameters(type(self))
        return {k: v for k, v in inputs.items() if k in accepted}

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """Repeat every prompt ``expand_size`` times (beam search, ``num_return_sequences``) together with
        *its own* images and videos: pixel rows and grids are packed over the batch, not per row, so a
        plain ``repeat_interleave`` of them would pair prompts with the wrong pictures."""
        if expand_size == 1:
            return input_ids, model_kwargs
        vision = {k: model_kwargs.pop(k) for k in _VISION_KWARGS if k in model_kwargs}
        prompt_ids = input_ids
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, input_ids=input_ids, **model_kwargs
        )
        model_kwargs.update(self._expand_vision_inputs(prompt_ids, vision, expand_size))
        return input_ids, model_kwargs

    def _expand_vision_inputs(self, input_ids, vision: dict[str, Any], n: int) -> dict[str, Any]:
        """Per-prompt repetition of packed vision inputs (see :meth:`_expand_inputs_for_generation`)."""
        out = dict(vision)
        m2 = self.config.vision.spatial_merge_size ** 2
        for pix_key, grid_key, tok, per_item in (
            ("pixel_values", "image_grid_thw", self.config.image_token_id, ()),
            ("pixel_values_videos", "video_grid_thw", self.config.video_token_id, ("second_per_grid_ts",)),
        ):
            grid = vision.get(grid_key)
            if grid is None or vision.get(pix_key) is None:
                continue
            if input_ids is None:
                raise KeyeInputError(f"{pix_key} need input_ids with placeholders to be repeated per prompt")
            sizes = [int(t * h * w) for t, h, w in grid.tolist()]
            wanted = (input_ids == tok).sum(dim=1).tolist()
            items: list[list[int]] = [[] for _ in wanted]
            row, filled = 0, 0
            for i, size in enumerate(sizes):
                while row < len(wanted) and filled >= wanted[row]:
                    row, filled = row + 1, 0
                if row == len(wanted):
                    raise KeyeInputError(f"{grid_key} has more items than the prompts have placeholder runs")
                items[row].append(i)
                filled += size // m2
            order = [i for row_items in items for _ in range(n) for i in row_items]
            starts = [0]
            for size in sizes:
                starts.append(starts[-1] + size)
            pix = vision[pix_key]
            out[pix_key] = (torch.cat([pix[starts[i]: starts[i] + sizes[i]] for i in order]) if order else pix[:0])
            out[grid_key] = grid[order]
            for key in per_item:
                val = vision.get(key)
                if torch.is_tensor(val) and val.reshape(-1).shape[0] == len(sizes):
                    out[key] = val.reshape(-1)[order]
        return out

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        return_step_logits: bool = False,
        **kwargs: Any,
    ):
        """Generate continuations of a (left-padded) batch with transformers' ``GenerationMixin.generate``.

        Accepts the processor's batch (``model.generate(**batch, max_new_tokens=64)``) and every
        ``generate`` argument of transformers: ``generation_config``, ``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``num_beams``, ``num_return_sequences``, ``min_new_tokens``,
        ``repetition_penalty``, ``no_repeat_ngram_size``, ``stop_strings`` (with ``tokenizer=``),
        ``streamer``, ``stopping_criteria``, ``logits_processor``, ``return_dict_in_generate`` with
        ``output_scores`` / ``output_logits``, ... Defaults come from the checkpoint's
        ``generation_config.json`` (else: EOS from the config, no top-k, at most 256 new tokens).

        Two Keye extras: ``generator`` (a ``torch.Generator``) makes sampling reproducible without touching
        the global RNG; with only Keye's own decoding fields (see
        :class:`~keye.model.generation.GenerationConfig`) it runs Keye's KV-cache loop
        (:meth:`generate_steps`), exactly as before, otherwise transformers' ``generate`` runs under an RNG
        seeded from it. ``return_step_logits=True`` (Keye's loop) also returns the raw logits.

        Returns:
            int64 [B * num_return_sequences, L + n_new]: the prompt followed by the new tokens (pad after
            a row's EOS), or transformers' output object with ``return_dict_in_generate=True``.
            With ``return_step_logits=True``: ``(sequences, float32 [B, n_new, V] logits)``.
        """
        if isinstance(attention_mask, HFGenerationConfig):  # transformers' second positional argument
            kwargs["generation_config"], attention_mask = attention_mask, None
        _check_decoding_args(kwargs)
        own_loop = set(kwargs) <= _KEYE_LOOP_KWARGS
        if return_step_logits:
            if not own_loop:
                extra = sorted(set(kwargs) - _KEYE_LOOP_KWARGS)
                raise KeyeInputError(
                    f"return_step_logits=True runs Keye's own decoding loop, which does not take {extra}; "
                    "use return_dict_in_generate=True, output_logits=True for transformers' equivalent"
                )
            return self._generate_keye(input_ids, attention_mask, generator=generator, return_step_logits=True, **kwargs)
        if generator is not None and own_loop:
            return self._generate_keye(input_ids, attention_mask, generator=generator, **kwargs)
        if input_ids is not None and attention_mask is None and "inputs_embeds" not in kwargs:
            # Keye's contract: no mask means no padding (never inferred from pad ids, which may be real tokens).
            attention_mask = torch.ones_like(input_ids)
        if kwargs.get("max_length") is not None and "max_new_tokens" not in kwargs:
            kwargs["max_new_tokens"] = None  # an explicit max_length wins over the default 256 new tokens
        gen_cfg = kwargs.get("generation_config") or self.generation_config
        if kwargs.get("do_sample", gen_cfg.do_sample) and "top_k" not in kwargs and gen_cfg.top_k is None:
            kwargs["top_k"] = 0  # Keye samples from the full distribution unless top_k is set (transformers: 50)
        if generator is None:
            return GenerationMixin.generate(self, input_ids, attention_mask=attention_mask, **kwargs)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return GenerationMixin.generate(self, input_ids, attention_mask=attention_mask, **kwargs)

    def _generate_keye(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                       return_step_logits: bool = False, **kwargs: Any):
        """Keye's own loop over :meth:`generate_steps` (see :meth:`generate`)."""
        steps = list(self.generate_steps(input_ids, attention_mask, **kwargs))
        if not steps:
            new = input_ids.new_zeros(input_ids.shape[0], 0)
            logits = torch.zeros(input_ids.shape[0], 0, self.config.text.vocab_size)
        else:
            new = torch.stack([s[0] for s in steps], dim=1)
            logits = torch.stack([s[1] for s in steps], dim=1)
        seqs = torch.cat([input_ids, new], dim=1)
        return (seqs, logits) if return_step_logits else seqs

    def stream(self, tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               skip_special_tokens: bool = True, **kwargs: Any) -> Iterator[str]:
        """Stream the generated text of a single prompt (batch size 1) piece by piece."""
        if input_ids.shape[0] != 1:
            raise KeyeInputError(f"stream() takes one prompt, got a batch of {input_ids.shape[0]}")
        eos = set(self._generation_config(**{k: v for k, v in kwargs.items() if k in GenerationConfig.__dataclass_fields__}).eos_ids)
        tokens = (int(t[0]) for t, _ in self.generate_steps(input_ids, attention_mask, **kwargs))
        yield from iter_text(tokenizer, (t for t in tokens if t not in eos), skip_special_tokens)

    # --------------------------------------------------------------------------------- weights
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args: Any,
        config: KeyeVLConfig | None = None,
        torch_dtype: str | torch.dtype | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        device_map: str | dict[str, Any] | torch.device | None = None,
        max_memory: dict[Any, Any] | None = None,
        low_cpu_mem_usage: bool | None = None,
        attn_implementation: str | None = None,
        revision: str | None = None,
        cache_dir: str | None = None,
        **kwargs: Any,
    ) -> KeyeVL:
        """Load an official (or keye-saved) checkpoint from a local directory, a hub id, or ``"keye-tiny"`` (the
        embedded default model, as every ``keye`` command names it; an unknown name raises
        :class:`KeyeWeightsError` pointing at ``keye.load_tiny()`` and hub ids).

        Single-file or sharded safetensors (``model.safetensors.index.json``) are read tensor by tensor
        straight into the requested dtype/device (the model skeleton is built on the meta device, so
        no memory is spent on a random init; ``low_cpu_mem_usage`` is therefore always in effect).
        Unused official tensors (``visual.vision_model.head.*``, ``packing_position_embedding``) are
        ignored; any other missing or unexpected tensor, or a shape mismatch, raises
        :class:`KeyeWeightsError` naming it.

        Args:
            torch_dtype / dtype: ``"auto"`` (default: the checkpoint's ``torch_dtype``), a name or a dtype.
            device: one device for every weight (default CPU).
            device_map: transformers/accelerate placement: a device, a dict ``{module prefix: device}``,
                or ``"auto"`` / ``"balanced"`` / ``"balanced_low_0"`` / ``"sequential"`` (planned by
                accelerate from ``max_memory``, layers kept whole); the model is then dispatched with
                accelerate's hooks so inputs follow the weights.
            config: a :class:`KeyeVLConfig` to use instead of the checkpoint's ``config.json``.
            attn_implementation, revision, cache_dir: as in transformers. Other hub keyword arguments that
                transformers' auto classes pass along (``trust_remote_code``, ``token``, ...) are accepted;
                Keye never runs remote code.
        The checkpoint's ``generation_config.json``, when present, becomes ``model.generation_config``.
        """
        if model_args:
            raise TypeError(f"KeyeVL.from_pretrained takes no extra positional arguments, got {len(model_args)}")
        unknown = sorted(k for k, v in kwargs.items() if k not in _HUB_KWARGS and not (k == "subfolder" and not v))
        if unknown:
            raise TypeError(f"KeyeVL.from_pretrained got unsupported argument(s): {', '.join(unknown)}")
        if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
            raise ValueError(f"torch_dtype={torch_dtype!r} and dtype={dtype!r} disagree; pass one of them")
        # "keye-tiny" (the name every CLI accepts) -> the embedded checkpoint; an unknown name says what works
        from keye.hub import resolve_pretrained

        where = resolve_pretrained(pretrained_model_name_or_path, error=KeyeWeightsError)
        directory = resolve_checkpoint(where, revision=revision, cache_dir=cache_dir)
        if config is None:
            overrides = {"attn_implementation": attn_implementation} if attn_implementation else {}
            config = KeyeVLConfig.from_json_file(directory, **overrides)
        else:
            if not isinstance(config, KeyeVLConfig):
                raise KeyeConfigError(f"config must be a KeyeVLConfig, got {type(config).__name__}")
            config = copy.deepcopy(config)
            if attn_implementation:
                config.attn_implementation = attn_implementation
        dtype = resolve_dtype(dtype if dtype is not None else (torch_dtype if torch_dtype is not None else "auto"),
                              config)
        del low_cpu_mem_usage  # always tensor by tensor onto a meta skeleton
        with torch.device("meta"):
            model = cls(config)
        placement = _plan_placement(model, device, device_map, max_memory, dtype)
        expected = {k: v for k, v in model.state_dict().items()}
        if config.text.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        state: dict[str, torch.Tensor] = {}
        unexpected = []
        for name, file, handle in iter_tensors(directory):
            if is_ignored_key(name):
                continue
            if name not in expected:
                unexpected.append(f"{name} (in {file.name})")
                continue
            tensor = handle.get_tensor(name)
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise KeyeWeightsError(
                    f"{file}: tensor {name} has shape {list(tensor.shape)}, the config expects "
                    f"{list(expected[name].shape)}"
                )
            target = placement(name)
            state[name] = tensor.to(device=target, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        missing = sorted(set(expected) - set(state))
        if unexpected or missing:
            parts = []
            if missing:
                parts.append(f"missing tensors: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}")
            if unexpected:
                parts.append(f"unexpected tensors: {', '.join(unexpected[:20])}{' ...' if len(unexpected) > 20 else ''}")
            raise KeyeWeightsError(f"{directory}: checkpoint does not match the config; " + "; ".join(parts))
        model.load_state_dict(state, strict=not config.text.tie_word_embeddings, assign=True)
        if config.text.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.config.torch_dtype = str(dtype).removeprefix("torch.")
        model.config.name_or_path = str(pretrained_model_name_or_path)
        model.name_or_path = str(pretrained_model_name_or_path)
        gen_file = directory / "generation_config.json"
        if gen_file.is_file():
            try:
                gen = HFGenerationConfig.from_pretrained(str(directory))
            except Exception as err:  # noqa: BLE001 - transformers raises several types for a bad file
                raise KeyeConfigError(f"{gen_file}: not a valid generation config ({err})") from None
            model.generation_config = model._default_generation_config(gen)
        if placement.device_map is not None:
            from accelerate import dispatch_model

            dispatch_model(model, device_map=placement.device_map)
            model.hf_device_map = placement.device_map
        return model.eval()

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        max_shard_size: int | str = "5GB",
        safe_serialization: bool = True,
        is_main_process: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write ``config.json`` (official flat format), ``generation_config.json`` (``model.generation_config``)
        and safetensors shards with the official tensor names; returns the directory.

        ``is_main_process=False`` writes nothing (distributed saving); ``state_dict`` replaces the model's
        own (e.g. a gathered FSDP state)."""
        directory = Path(save_directory)
        if not safe_serialization:
            raise ValueError("keye writes safetensors only (safe_serialization=False is not supported)")
        if not is_main_process:
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        state = dict(state_dict) if state_dict is not None else self.state_dict()
        if self.config.text.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_state_dict(state, directory, max_shard_size=max_shard_size)
        self.config.torch_dtype = str(self.dtype).removeprefix("torch.")
        self.config.to_json_file(directory / "config.json")
        self.generation_config.save_pretrained(str(directory))
        return directory


class KeyeVL1_5ForConditionalGeneration(KeyeVL):  # noqa: N801 - the official architecture name
    """:class:`KeyeVL` for Keye-VL-1.5 configs (what the auto classes return for model type ``KeyeVL1_5``)."""

    config_class = KeyeVL1_5Config


# Keyword arguments transformers' auto classes and hub helpers pass along, accepted and not needed here.
_HUB_KWARGS = frozenset({
    "_from_auto", "_from_pipeline", "trust_remote_code", "adapter_kwargs", "token", "local_files_only",
    "force_download", "proxies", "code_revision", "use_safetensors", "_commit_hash", "subfolder",
})
_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


class _Placement:
    """Where each checkpoint tensor goes: one device, or the longest matching prefix of a device map."""

    def __init__(self, device: torch.device, device_map: dict[str, Any] | None):
        self.device = device
        self.device_map = device_map

    def __call__(self, name: str) -> torch.device | str:
        if self.device_map is None:
            return self.device
        best, where = -1, None
        for prefix, dev in self.device_map.items():
            if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), dev
        if where is None:
            raise KeyeWeightsError(f"device_map places no module holding tensor {name}")
        if where == "disk":
            raise KeyeWeightsError(
                f"device_map puts {name} on disk; disk offload is not supported, give max_memory more room"
            )
        return torch.device(where) if isinstance(where, str) else (f"cuda:{where}" if isinstance(where, int) else where)


def _plan_placement(model: KeyeVL, device, device_map, max_memory, dtype: torch.dtype) -> _Placement:
    """Resolve ``device`` / ``device_map`` (see :meth:`KeyeVL.from_pretrained`) into a :class:`_Placement`."""
    if device_map is None:
        return _Placement(torch.device(device) if device is not None else torch.device("cpu"), None)
    if device is not None:
        raise ValueError("pass either device or device_map, not both")
    if isinstance(device_map, (int, torch.device)) or (isinstance(device_map, str) and device_map not in _AUTO_MAPS):
        return _Placement(torch.device(f"cuda:{device_map}" if isinstance(device_map, int) else device_map), None)
    if isinstance(device_map, dict):
        return _Placement(torch.device("cpu"), dict(device_map))
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = sorted(model._no_split_modules)
    if device_map != "sequential":
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         dtype=dtype, low_zero=device_map == "balanced_low_0")
    plan = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    return _Placement(torch.device("cpu"), dict(plan))


# This module imports transformers: finish the auto-class registration if it was waiting on us (keye/__init__).
import keye as _keye  # noqa: E402

_keye._register()
