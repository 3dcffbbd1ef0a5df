"""KeyeVL: vision tower + projector + Qwen3 decoder, with loading, saving, loss and generation.

Parameter names are exactly the official checkpoints' (``visual.vision_model.*``, ``mlp_AR.*``,
``model.*``, ``lm_head.weight``), so the official Keye-VL-8B-Preview and Keye-VL-1.5-8B files load
unchanged and ``save_pretrained`` output loads back in the official code and in vLLM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from keye.config import KeyeVLConfig
from keye.errors import KeyeInputError, KeyeWeightsError
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
class KeyeOutput:
    """Result of :meth:`KeyeVL.forward`.

    logits: [B, L', vocab] (L' = L, or ``logits_to_keep`` last positions).
    loss: mean (or summed, see ``loss_reduction``) cross entropy over target tokens, if labels given.
    num_target_tokens: number of label tokens != -100 that entered the loss.
    rope_deltas: [B, 1] offsets for decoding positions (prefill only).
    position_ids: [3, B, L] positions used.
    past_key_values: the KV cache when ``use_cache``.
    hidden_states: final normed hidden states [B, L, D] when ``output_hidden_states``.
    """

    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    num_target_tokens: int | None = None
    rope_deltas: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    past_key_values: KVCache | None = None
    hidden_states: torch.Tensor | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


class KeyeVL(nn.Module):
    """The Keye-VL model (both the 8B-Preview and the 1.5 variants, chosen by ``config.variant``).

    Children (= checkpoint prefixes): ``visual`` (SigLIP tower), ``mlp_AR`` (projector), ``model``
    (Qwen3 decoder) and ``lm_head``.
    """

    def __init__(self, config: KeyeVLConfig):
        super().__init__()
        self.config = config
        self.visual = KeyeVisionModel(config.vision)
        self.mlp_AR = Projector(config)
        self.model = TextModel(config.text)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.text.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.set_attn_implementation(config.attn_implementation)

    # ------------------------------------------------------------------------------ switches
    def set_attn_implementation(self, name: str) -> None:
        """Switch every attention layer to ``sdpa``, ``eager`` or ``flash_attention_2``."""
        check_backend(name)
        self.config.attn_implementation = name
        for module in self.modules():
            if hasattr(module, "backend"):
                module.backend = name

    def gradient_checkpointing_enable(self) -> None:
        """Recompute decoder and vision layers in backward (less activation memory, ~30% more compute)."""
        self.model.gradient_checkpointing = True
        self.visual.vision_model.encoder.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False
        self.visual.vision_model.encoder.gradient_checkpointing = False

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

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
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with image/video features written into their placeholder slots.

        Images and videos go through the tower in **one** packed call (attention stays block-diagonal
        per item, so this equals separate calls). In training with ``always_run_vision`` set (done by
        the recipes for DDP/FSDP/ZeRO), a batch without pixels still runs the tower on one dummy item
        whose output is added with weight 0: every rank then runs the same modules in the same order,
        which sharded and data-parallel training require.
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
            if self.training and getattr(self, "always_run_vision", False):
                m = self.config.vision.spatial_merge_size
                p = self.config.vision.patch_size
                dummy = torch.zeros(m * m, self.config.vision.num_channels, p, p, device=embeds.device)
                feats = self.mlp_AR(self.visual(dummy, [(1, m, m)]), [(1, m, m)])
                embeds = embeds + 0.0 * feats.sum().to(embeds.dtype)
            return embeds
        feats = self.mlp_AR(self.visual(torch.cat(pieces) if len(pieces) > 1 else pieces[0], grids), grids)
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
        self,
        input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
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
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        rope_deltas: torch.Tensor | None = None,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        num_frames: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        loss_reduction: str = "mean",
        output_hidden_states: bool = False,
        inputs_embeds: torch.Tensor | None = None,
        attention_override=None,
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
        """
        del num_frames
        cache = past_key_values
        if use_cache and cache is None:
            cache = KVCache(len(self.model.layers))
        past = cache.length if cache is not None else 0
        packed = seq_lens is not None
        if packed:
            seq_lens = [int(x) for x in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
            if cache is not None:
                raise KeyeInputError("packed sequences (seq_lens) cannot be used with a KV cache")

        if inputs_embeds is None:
            if past == 0:
                inputs_embeds = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
            else:
                inputs_embeds = self.model.embed_tokens(input_ids)
        bsz, seq = input_ids.shape

        if position_ids is None:
            if past == 0:
                position_ids, rope_deltas = self.get_rope_index(
                    input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts,
                    None if packed else attention_mask, seq_lens if packed else None,
                )
            else:
                if rope_deltas is None:
                    rope_deltas = torch.zeros(bsz, 1, dtype=torch.long, device=input_ids.device)
                step = torch.arange(past, past + seq, device=input_ids.device)[None, :] + rope_deltas.to(input_ids.device)
                position_ids = step[None].expand(3, -1, -1)
        inv_freq = text_inv_freq(self.config.text.head_dim, self.config.text.rope_theta, device=inputs_embeds.device)
        cos, sin = mrope_cos_sin(position_ids, inv_freq, self.config.text.mrope_section, inputs_embeds.dtype)

        cu_seqlens = None
        if packed:
            cu_seqlens = torch.tensor([0, *seq_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
        key_mask = attention_mask
        if key_mask is not None and cache is None and bool(key_mask.all()):
            key_mask = None
        hidden = self.model(inputs_embeds, cos, sin, key_mask, cache, cu_seqlens, attention_override)

        keep = hidden if logits_to_keep <= 0 else hidden[:, -logits_to_keep:]
        logits = self.lm_head(keep)

        loss = None
        n_target = None
        if labels is not None:
            shift_labels = labels[:, 1:].clone()
            if packed:
                ends = cu_seqlens[1:-1].long() - 1  # last token of each sample but the final one
                shift_labels[0, ends] = -100
            full_logits = logits if logits_to_keep <= 0 else self.lm_head(hidden)
            shift_logits = full_logits[:, :-1].float()
            n_target = int((shift_labels != -100).sum())
            loss = F.cross_entropy(
                shift_logits.reshape(-1, shift_logits.shape[-1]),
                shift_labels.reshape(-1).to(shift_logits.device),
                ignore_index=-100,
                reduction="sum",
            )
            if loss_reduction == "mean":
                loss = loss / max(n_target, 1)
            elif loss_reduction != "sum":
                raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        return KeyeOutput(
            logits=logits,
            loss=loss,
            num_target_tokens=n_target,
            rope_deltas=rope_deltas,
            position_ids=position_ids,
            past_key_values=cache,
            hidden_states=hidden if output_hidden_states else None,
        )

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

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 return_step_logits: bool = False, **kwargs: Any):
        """Generate continuations of a (left-padded) batch.

        Accepts the processor's batch (``model.generate(**batch, max_new_tokens=64)``) plus
        :class:`~keye.model.generation.GenerationConfig` fields (``do_sample``, ``temperature``,
        ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``) and an optional
        ``generator`` for reproducible sampling.

        Returns:
            int64 [B, L + n_new]: the prompt followed by the new tokens (pad after a row's EOS).
            With ``return_step_logits=True``, also float32 [B, n_new, V], the logits that chose each token.
        """
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
        name_or_path: str | os.PathLike,
        *,
        torch_dtype: str | torch.dtype | None = "auto",
        device: str | torch.device | None = None,
        attn_implementation: str | None = None,
        revision: str | None = None,
        cache_dir: str | None = None,
    ) -> KeyeVL:
        """Load an official (or keye-saved) checkpoint from a local directory or a hub id.

        Single-file or sharded safetensors (``model.safetensors.index.json``) are read tensor by tensor
        straight into the requested dtype/device (the model skeleton is built on the meta device, so
        no memory is spent on a random init). Unused official tensors (``visual.vision_model.head.*``,
        ``packing_position_embedding``) are ignored; any other missing or unexpected tensor, or a
        shape mismatch, raises :class:`KeyeWeightsError` naming it.
        """
        directory = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
        overrides = {"attn_implementation": attn_implementation} if attn_implementation else {}
        config = KeyeVLConfig.from_json_file(directory, **overrides)
        dtype = resolve_dtype(torch_dtype, config)
        device = torch.device(device) if device is not None else torch.device("cpu")
        with torch.device("meta"):
            model = cls(config)
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
            state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
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
        model.name_or_path = str(name_or_path)
        return model.eval()

    def save_pretrained(self, directory: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> Path:
        """Write ``config.json`` (official flat format), ``generation_config.json`` and safetensors
        shards with the official tensor names; returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        if self.config.text.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_state_dict(state, directory, max_shard_size=max_shard_size)
        self.config.torch_dtype = str(self.dtype).removeprefix("torch.")
        self.config.to_json_file(directory / "config.json")
        gen = {"eos_token_id": self.config.eos_token_ids, "pad_token_id": self.config.pad_token_id,
               "bos_token_id": self.config.bos_token_id}
        (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        return directory
