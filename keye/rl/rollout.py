"""Rollout engines and the per-sample records that carry a rollout into training.

A rollout keeps, per prompt, the *exact* processor outputs it generated from (:class:`PromptInputs`:
unpadded ``input_ids``, pixel rows, grids, ``second_per_grid_ts``); :func:`collate_samples` re-batches them
(left-padded prompts + right-padded responses) for the training forward, which therefore sees the same
pixels and recomputes the same 3-D positions as the generation did (training.md §8.10).

Engines implement :class:`RolloutEngine`: :class:`LocalRollout` (in-process batched generation with the KV
cache, CPU or GPU) and :class:`VLLMRollout` (vLLM's ``LLM.generate``, only where ``vllm`` imports).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.masks import lengths_to_mask, response_lengths

_VISION_ROW_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


# ------------------------------------------------------------------------------------------------ records
@dataclass
class RLPrompt:
    """One RL question.

    ``id``: stable question id (replay pool key). ``messages``: the conversation (qwen-vl-utils form) up to
    the last user turn. ``reference`` / ``task``: what the reward checks against. ``mode``: thinking mode
    applied before processing (``"think"``, ``"no_think"``, ``"auto"`` or None = messages as given).
    ``extra``: per-sample reward extras (``choices``, ``instructions``, ...).
    """

    id: str
    messages: list[dict[str, Any]]
    reference: Any = None
    task: str | None = None
    mode: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptInputs:
    """The processor outputs of one prompt: ``input_ids`` int [L] (no padding) and its vision rows
    (``pixel_values`` [n, 3, p, p], ``image_grid_thw`` [k, 3], ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts`` [v]); absent modalities are None."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Number of prompt tokens."""
        return int(self.input_ids.shape[0])


@dataclass
class RolloutSample:
    """One response of a group.

    ``group``: index of its prompt in the rollout call (the group id of the advantage). ``response_ids``:
    int64 [n] generated tokens up to and including the first EOS (nothing after). ``finished``: ended
    with an EOS (False = cut at ``max_new_tokens``). ``source``: ``"rollout"`` or ``"replay"``.
    ``valid``: False for a missing replay slot (no tokens, excluded from advantages and loss).
    ``rollout_logp``: float32 [n] log-probs of the sampled tokens under the engine's (tempered,
    unfiltered) distribution, when the engine provides them. ``reward`` / ``passed`` / ``advantage``: filled
    by scoring and :func:`keye.rl.advantages.sample_advantages`; ``old_logp`` / ``ref_logp``: float32 [n]
    filled by :func:`keye.rl.update.fill_logprobs` (behaviour and reference policy).
    """

    prompt: RLPrompt
    group: int
    inputs: PromptInputs
    response_ids: torch.Tensor
    text: str
    finished: bool
    source: str = "rollout"
    valid: bool = True
    rollout_logp: torch.Tensor | None = None
    reward: float | None = None
    passed: bool | None = None
    advantage: float | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Response tokens that enter the loss (0 for an invalid sample)."""
        return int(self.response_ids.numel()) if self.valid else 0


# ------------------------------------------------------------------------------------- splitting batches
def _rows_for_tokens(grids: torch.Tensor | None, n_tokens: int, start: int, merge: int, where: str) -> int:
    """How many consecutive grid rows from ``start`` account for ``n_tokens`` placeholder tokens."""
    end, got = start, 0
    while got < n_tokens:
        if grids is None or end >= grids.shape[0]:
            raise KeyeInputError(f"{where}: {n_tokens} placeholders but the grids run out after {got}")
        t, h, w = (int(v) for v in grids[end])
        got += t * h * w // (merge * merge)
        end += 1
    if got != n_tokens:
        raise KeyeInputError(f"{where}: {n_tokens} placeholders do not match whole grid rows ({got} tokens)")
    return end


def split_batch(batch: Mapping[str, torch.Tensor], image_token_id: int, video_token_id: int,
                merge_size: int = 2) -> list[PromptInputs]:
    """Split a processor batch (any padding side) into one :class:`PromptInputs` per row.

    Vision rows are assigned to batch rows in order by counting each row's ``<|image_pad|>`` /
    ``<|video_pad|>`` tokens (``t*h*w / merge_size**2`` per grid row), which is how the processor numbered
    them. Raises :class:`KeyeInputError` if the counts and grids disagree.
    """
    ids, att = batch["input_ids"], batch.get("attention_mask")
    out: list[PromptInputs] = []
    img_row = vid_row = img_px = vid_px = 0
    img_grid, vid_grid = batch.get("image_grid_thw"), batch.get("video_grid_thw")
    secs = batch.get("second_per_grid_ts")
    for b in range(ids.shape[0]):
        row = ids[b] if att is None else ids[b][att[b].bool()]
        n_img = int((row == image_token_id).sum())
        n_vid = int((row == video_token_id).sum())
        item = PromptInputs(row.clone())
        if n_img:
            end = _rows_for_tokens(img_grid, n_img, img_row, merge_size, f"row {b} images")
            grids = img_grid[img_row:end]
            n_px = int(grids.prod(dim=1).sum())
            item.pixel_values = batch["pixel_values"][img_px : img_px + n_px]
            item.image_grid_thw = grids
            img_row, img_px = end, img_px + n_px
        if n_vid:
            end = _rows_for_tokens(vid_grid, n_vid, vid_row, merge_size, f"row {b} videos")
            grids = vid_grid[vid_row:end]
            n_px = int(grids.prod(dim=1).sum())
            item.pixel_values_videos = batch["pixel_values_videos"][vid_px : vid_px + n_px]
            item.video_grid_thw = grids
            if secs is not None:
                item.second_per_grid_ts = secs[vid_row:end]
            vid_row, vid_px = end, vid_px + n_px
        out.append(item)
    return out


def collate_prompts(prompts: Sequence[PromptInputs], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad prompts into a generation batch: ``input_ids`` / ``attention_mask`` int64 [B, L] plus the
    vision rows concatenated in row order (the order ``get_rope_index`` consumes them)."""
    if not prompts:
        raise KeyeInputError("cannot collate an empty list of prompts")
    length = max(p.length for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    att = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, length - p.length :] = p.input_ids
        att[i, length - p.length :] = 1
    out: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": att}
    for key in _VISION_ROW_KEYS:
        parts = [getattr(p, key) for p in prompts if getattr(p, key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def collate_samples(
    samples: Sequence[RolloutSample], pad_id: int, exclude_ids: Sequence[int] = ()
) -> dict[str, torch.Tensor]:
    """Batch samples for the training forward (:func:`keye.rl.logprobs.token_logprobs`).

    Returns the :func:`collate_prompts` keys plus ``responses`` int64 [B, N] (right-padded with ``pad_id``),
    ``response_attention`` bool [B, N] (real tokens), ``response_mask`` bool [B, N] (loss mask: real tokens
    minus ``exclude_ids``; all False for invalid samples), ``group_ids`` int64 [B], ``valid`` bool [B] and
    ``is_replay`` bool [B]; when every sample has them, ``advantages`` float32 [B] and ``old_logp`` /
    ``ref_logp`` float32 [B, N] (0 on padding).
    """
    batch = collate_prompts([s.inputs for s in samples], pad_id)
    n = max((int(s.response_ids.numel()) for s in samples), default=0)
    resp = torch.full((len(samples), n), pad_id, dtype=torch.long)
    lengths = torch.zeros(len(samples), dtype=torch.long)
    for i, s in enumerate(samples):
        k = int(s.response_ids.numel()) if s.valid else 0
        resp[i, :k] = s.response_ids[:k]
        lengths[i] = k
    attn = lengths_to_mask(lengths, n)
    mask = attn.clone()
    if exclude_ids:
        mask &= ~torch.isin(resp, torch.tensor(list(exclude_ids), dtype=torch.long))
    batch.update(
        responses=resp,
        response_attention=attn,
        response_mask=mask,
        group_ids=torch.tensor([s.group for s in samples], dtype=torch.long),
        valid=torch.tensor([s.valid for s in samples], dtype=torch.bool),
        is_replay=torch.tensor([s.source == "replay" for s in samples], dtype=torch.bool),
    )
    if all(s.advantage is not None for s in samples):
        batch["advantages"] = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32)
    for key in ("old_logp", "ref_logp"):
        if all(getattr(s, key) is not None or not s.valid for s in samples):
            values = torch.zeros(len(samples), n, dtype=torch.float32)
            for i, s in enumerate(samples):
                k = int(lengths[i])
                if k:
                    values[i, :k] = getattr(s, key)[:k].float()
            batch[key] = values
    return batch


# ---------------------------------------------------------------------------------------------- engines
@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples ``n`` responses for each prompt.

    ``generate(prompts, n)`` returns ``len(prompts) * n`` :class:`RolloutSample` ordered prompt by prompt
    (sample ``j`` of prompt ``i`` at index ``i * n + j``, ``group == i``).
    """

    def generate(self, prompts: Sequence[RLPrompt], n: int) -> list[RolloutSample]:
        """``n`` samples per prompt, prompt by prompt."""
        ...


def _apply_mode(messages: list[dict[str, Any]], mode: str | None) -> list[dict[str, Any]]:
    from keye.processing.chat import apply_mode

    return apply_mode(messages, mode)


class LocalRollout:
    """In-process batched sampling with the model's KV cache (CPU or GPU).

    Args:
        model: a :class:`keye.KeyeVL` (generation runs under ``no_grad`` in eval mode; the previous mode
            is restored).
        processor: a :class:`keye.KeyeProcessor` (its ``__call__`` builds the prompt batch).
        max_new_tokens, temperature, top_p, top_k: sampling settings (RLEP: 1.0 / 1.0 / off).
        max_batch_size: sequences decoded together (prompts are repeated ``n`` times, then chunked).
        seed: seeds the sampling generator (on the model's device at construction: build the engine after
            moving the model); the same seed, model and prompts give the same samples.
        eos_token_id: one or several stop ids (default: the model config's).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Any,
        *,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_batch_size: int = 64,
        seed: int = 0,
        eos_token_id: int | Sequence[int] | None = None,
    ):
        if max_batch_size < 1:
            raise KeyeConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if temperature <= 0:
            raise KeyeConfigError(f"temperature must be > 0 for sampling rollouts, got {temperature}")
        self.model = model
        self.processor = processor
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.max_batch_size = max_batch_size
        eos = model.config.eos_token_ids if eos_token_id is None else eos_token_id
        self.eos_ids = [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        self.pad_id = int(processor.pad_token_id)
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.weight_version = 0  # the learner step whose weights the model holds (see load_weights)

    def state_dict(self) -> dict[str, Any]:
        """The sampling generator's state (for exact resume from a checkpoint)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; later samples continue the saved random stream.

        Raises:
            KeyeConfigError: ``state`` was written by another engine kind.
        """
        if "generator" not in state:
            raise KeyeConfigError(f"the saved rollout state {sorted(state)} is not a local engine's: resume with the "
                                  "rollout.engine the run was started with")
        self.generator.set_state(state["generator"])

    def load_weights(self, shards: Iterable[Mapping[str, torch.Tensor]], version: int | None = None) -> int:
        """Copy weight shards ``{name: full tensor}`` (e.g. :meth:`keye.rl.learner.Learner.export_weights`)
        into the sampling model, shard by shard; every model weight must arrive exactly once.

        Returns the number of tensors loaded; ``version`` (the learner step) becomes ``weight_version``.
        Raises:
            KeyeInputError: an unknown name, a shape mismatch, a tensor sent twice or one never sent.
        """
        own = self.model.state_dict()
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
        self.weight_version = version
        return len(seen)

    def prepare(self, prompts: Sequence[RLPrompt]) -> list[PromptInputs]:
        """Process each prompt (its mode applied) once; the result is shared by its ``n`` samples."""
        convs = [_apply_mode(p.messages, p.mode) for p in prompts]
        batch = self.processor(convs, return_tensors="pt")
        merge = self.processor.image_processor.config.merge_size
        return split_batch(batch, self.processor.image_token_id, self.processor.video_token_id, merge)

    @torch.no_grad()
    def _decode(self, inputs: list[PromptInputs]) -> tuple[torch.Tensor, torch.Tensor]:
        from keye.rl.logprobs import model_inputs

        batch = collate_prompts(inputs, self.pad_id)
        device, dtype = self.model.device, self.model.dtype
        kwargs = model_inputs(batch, device, dtype)
        tokens, logps = [], []
        steps = self.model.generate_steps(
            batch["input_ids"].to(device), batch["attention_mask"].to(device), generator=self.generator,
            max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, eos_token_id=self.eos_ids, pad_token_id=self.pad_id, **kwargs,
        )
        for nxt, logits in steps:
            lp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
            tokens.append(nxt.cpu())
            logps.append(lp.gather(1, nxt[:, None]).squeeze(1).cpu())
        if not tokens:
            z = torch.zeros(len(inputs), 0)
            return z.long(), z
        return torch.stack(tokens, 1), torch.stack(logps, 1)

    def generate(self, prompts: Sequence[RLPrompt], n: int) -> list[RolloutSample]:
        """Sample ``n`` responses per prompt; see :class:`RolloutEngine` for the order."""
        if n < 1:
            raise KeyeConfigError(f"n (rollouts per prompt) must be >= 1, got {n}")
        if not prompts:
            return []
        inputs = self.prepare(prompts)
        flat = [(i, inputs[i]) for i in range(len(prompts)) for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        samples: list[RolloutSample] = []
        try:
            for s in range(0, len(flat), self.max_batch_size):
                chunk = flat[s : s + self.max_batch_size]
                toks, lps = self._decode([x for _, x in chunk])
                lengths = response_lengths(toks, self.eos_ids)
                for (i, pin), row, lp, k in zip(chunk, toks, lps, lengths.tolist()):
                    ids = row[:k].clone()
                    finished = bool(k > 0 and int(ids[-1]) in self.eos_ids)
                    samples.append(RolloutSample(
                        prompt=prompts[i], group=i, inputs=pin, response_ids=ids,
                        text=self.processor.decode(ids, skip_special_tokens=True), finished=finished,
                        rollout_logp=lp[:k].clone(), metadata={"mode": prompts[i].mode},
                    ))
        finally:
            self.model.train(was_training)
        return samples


class VLLMRollout:
    """Rollouts with vLLM (``vllm.LLM``) on a GPU host; weights synced from the trainer by name.

    The prompt sent to vLLM is the rendered chat template (one placeholder per image/video; vLLM's Keye
    processor expands it) with the loaded images / sampled video frames as ``multi_modal_data``. The training
    side still uses our processor's outputs for the same conversation (``prepare``), so the training forward
    gets our pixels and positions; the response token ids come from vLLM.

    Args:
        llm: a constructed ``vllm.LLM`` or a model path/hub id (then ``LLM(model=..., **llm_kwargs)``).
        processor: a :class:`keye.KeyeProcessor` of the same checkpoint.
        max_new_tokens, temperature, top_p, top_k, seed: sampling settings (``SamplingParams``); call ``i``
            of :meth:`generate` samples with seed ``seed + i`` (the call count is in :meth:`state_dict`).
    Raises:
        KeyeConfigError: when ``vllm`` cannot be imported.

    The engine holds its own copy of the weights: ``weight_version`` is the version of the policy it serves
    (0: the checkpoint it was built from; then the ``version`` of the last :meth:`sync_weights`, the
    trainer's step). A trainer must sync after every update and, after a resume, before the first rollout.
    """

    def __init__(self, llm: Any, processor: Any, *, max_new_tokens: int = 256, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, **llm_kwargs: Any):
        try:
            import vllm
        except ImportError as err:
            raise KeyeConfigError(
                "VLLMRollout needs the 'vllm' package (GPU hosts only: pip install vllm); "
                f"it could not be imported ({err}). Use LocalRollout instead."
            ) from None
        self._vllm = vllm
        self.llm = vllm.LLM(model=str(llm), **llm_kwargs) if isinstance(llm, (str, bytes)) or hasattr(llm, "__fspath__") else llm
        self.processor = processor
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self._calls = 0
        self.weight_version = 0

    def state_dict(self) -> dict[str, Any]:
        """The sampling-seed counter (for exact resume). The weights are not part of it: they are the
        trainer's model, pushed again with :meth:`sync_weights` after a resume."""
        return {"calls": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: later calls continue the saved seed sequence. ``weight_version`` is
        left alone (this engine still holds what it was built from or last synced).

        Raises:
            KeyeConfigError: ``state`` was written by another engine kind.
        """
        if "calls" not in state:
            raise KeyeConfigError(f"the saved rollout state {sorted(state)} is not a vLLM engine's: resume with the "
                                  "rollout.engine the run was started with")
        self._calls = int(state["calls"])

    def prepare(self, prompts: Sequence[RLPrompt]) -> list[PromptInputs]:
        """Our processor's outputs for the prompts (what the training forward will see)."""
        convs = [_apply_mode(p.messages, p.mode) for p in prompts]
        batch = self.processor(convs, return_tensors="pt")
        merge = self.processor.image_processor.config.merge_size
        return split_batch(batch, self.processor.image_token_id, self.processor.video_token_id, merge)

    def _request(self, prompt: RLPrompt) -> dict[str, Any]:
        from keye.processing.chat import item_kind
        from keye.processing.image import fetch_image
        from keye.processing.video import VideoOptions, fetch_video

        conv = _apply_mode(prompt.messages, prompt.mode)
        text = self.processor.chat_template.render(conv, True)
        images, videos = [], []
        for m in conv:
            if isinstance(m["content"], str):
                continue
            for c in m["content"]:
                kind = item_kind(c)
                if kind == "image":
                    images.append(fetch_image(c.get("image", c.get("image_url")), self.processor.variant,
                                              min_pixels=c.get("min_pixels"), max_pixels=c.get("max_pixels")))
                elif kind == "video":
                    v = fetch_video(c["video"], VideoOptions.from_item(c), self.processor.variant)
                    videos.append(v.frames)
        req: dict[str, Any] = {"prompt": text}
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images
        if videos:
            mm["video"] = videos
        if mm:
            req["multi_modal_data"] = mm
        return req

    def generate(self, prompts: Sequence[RLPrompt], n: int) -> list[RolloutSample]:
        """Sample ``n`` responses per prompt with ``LLM.generate``; order as in :class:`RolloutEngine`."""
        if n < 1:
            raise KeyeConfigError(f"n (rollouts per prompt) must be >= 1, got {n}")
        inputs = self.prepare(prompts)
        params = self._vllm.SamplingParams(
            n=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k if self.top_k > 0 else -1,
            max_tokens=self.max_new_tokens, seed=self.seed + self._calls, logprobs=0,
        )
        self._calls += 1
        outputs = self.llm.generate([self._request(p) for p in prompts], params, use_tqdm=False)
        samples = []
        for i, out in enumerate(outputs):
            for comp in out.outputs:
                ids = torch.tensor(list(comp.token_ids), dtype=torch.long)
                lp = None
                if comp.logprobs:
                    lp = torch.tensor([step[int(t)].logprob for step, t in zip(comp.logprobs, comp.token_ids)])
                samples.append(RolloutSample(
                    prompt=prompts[i], group=i, inputs=inputs[i], response_ids=ids, text=comp.text,
                    finished=comp.finish_reason == "stop", rollout_logp=lp, metadata={"mode": prompts[i].mode},
                ))
        return samples

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Load trainer weights into the vLLM model by (official) parameter name; returns the count.

        Uses ``LLM.apply_model`` (vLLM >= 0.7) to call the model's ``load_weights`` in every worker, falling
        back to the single-process driver worker of older versions. ``weight_version`` becomes ``version``
        (default: the previous version + 1).
        """
        items = [(k, v.detach()) for k, v in state_dict.items()]

        def _load(model: Any) -> None:
            model.load_weights(iter(items))

        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(_load)
        else:
            _load(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return len(items)


def group_size_check(samples: Sequence[RolloutSample], n_prompts: int, n: int) -> None:
    """Raise :class:`KeyeInputError` unless ``samples`` hold exactly ``n`` samples per group 0..n_prompts-1."""
    counts = [0] * n_prompts
    for s in samples:
        if not 0 <= s.group < n_prompts:
            raise KeyeInputError(f"sample group {s.group} is outside 0..{n_prompts - 1}")
        counts[s.group] += 1
    bad = [i for i, c in enumerate(counts) if c != n]
    if bad:
        raise KeyeInputError(f"groups {bad[:5]} do not have {n} samples (counts {[counts[i] for i in bad[:5]]})")

