"""Rollout engines and the per-sample records that carry a rollout into training.

A rollout keeps, per prompt, the *exact* processor outputs it generated from (:class:`PromptInputs`:
unpadded ``input_ids``, pixel rows, grids, ``second_per_grid_ts``); :func:`collate_samples` re-batches them
(left-padded prompts + right-padded responses) for the training forward, which therefore sees the same
pixels and recomputes the same 3-D positions as the generation did (training.md §8.10).

Engines implement :class:`RolloutEngine`: :class:`LocalRollout` (in-process batched generation with the KV
cache, CPU or GPU) and :class:`VLLMRollout` (vLLM's ``LLM.generate``, only where ``vllm`` imports; tested on CPU
against the recording stand-in ``tests/train/_fake_vllm.py``). Both record each sample's ``rollout_logp``, the
log-probs of the distribution it was sampled from, for the truncated importance-sampling correction.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.rollout.masks import response_lengths
from keye.rl.rollout.samples import (
    PromptInputs,
    RLPrompt,
    RolloutSample,
    collate_prompts,
    prefix_ids,
    split_batch,
)
from keye.rl.rollout.settings import SamplingSettings
from keye.train.models import load_weight_shards


def _apply_mode(messages: list[dict[str, Any]], mode: str | None) -> list[dict[str, Any]]:
    from keye.processing.chat import apply_mode

    return apply_mode(messages, mode)


class LocalRollout:
    """In-process batched sampling with the model's KV cache (CPU or GPU).

    Args:
        model: a :class:`keye.KeyeVL` (generation runs under ``no_grad`` in eval mode; the previous mode
            is restored).
        processor: a :class:`keye.KeyeProcessor` (its ``__call__`` builds the prompt batch).
        sampling: the run's :class:`~keye.rl.rollout.settings.SamplingSettings` (default: its defaults);
            ``max_batch_size`` sequences are decoded together (prompts are repeated ``n`` times, then chunked).
        seed: seeds the sampling generator (on the model's device at construction: build the engine after
            moving the model); the same seed, model and prompts give the same samples.
        eos_token_id: one or several stop ids (default: the model config's).
    """

    def __init__(self, model: torch.nn.Module, processor: Any, sampling: SamplingSettings | None = None, *,
                 seed: int = 0, eos_token_id: int | Sequence[int] | None = None):
        self.model = model
        self.processor = processor
        self.sampling = sampling if sampling is not None else SamplingSettings()
        s = self.sampling
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = s.max_new_tokens, s.temperature, s.top_p, s.top_k
        self.max_batch_size = s.max_batch_size
        eos = model.config.eos_token_ids if eos_token_id is None else eos_token_id
        self.eos_ids = [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        self.pad_id = int(processor.pad_token_id)
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.weight_version = 0  # the learner step whose weights the model holds (see load_weights)

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream from ``seed`` (the trainer does it every step, so a step's samples do
        not depend on how many random numbers earlier steps drew)."""
        self.generator.manual_seed(seed)

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
        """Copy weight shards ``{name: full tensor}`` (e.g. :meth:`keye.rl.learner.learner.Learner.export_weights`)
        into the sampling model (:func:`load_weight_shards`); ``version`` (the learner step) becomes
        ``weight_version``. Returns the number of tensors loaded."""
        n = load_weight_shards(self.model, shards)
        self.weight_version = version
        return n

    def prepare(self, prompts: Sequence[RLPrompt]) -> list[PromptInputs]:
        """Process each prompt (its mode applied) once; the result is shared by its ``n`` samples."""
        convs = [_apply_mode(p.messages, p.mode) for p in prompts]
        batch = self.processor(convs, return_tensors="pt")
        merge = self.processor.image_processor.config.merge_size
        return split_batch(batch, self.processor.image_token_id, self.processor.video_token_id, merge)

    @torch.no_grad()
    def _decode(self, inputs: list[PromptInputs]) -> tuple[torch.Tensor, torch.Tensor]:
        from keye.model.generation import top_k_top_p_filter
        from keye.train.logprobs import model_inputs

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
            # the distribution select_next_tokens drew from: tempered, then top-k / top-p filtered
            sampled_from = top_k_top_p_filter(logits.float() / self.temperature, self.top_k, self.top_p)
            lp = torch.log_softmax(sampled_from, dim=-1)
            tokens.append(nxt.cpu())
            logps.append(lp.gather(1, nxt[:, None]).squeeze(1).cpu())
        if not tokens:
            z = torch.zeros(len(inputs), 0)
            return z.long(), z
        return torch.stack(tokens, 1), torch.stack(logps, 1)

    def generate(self, prompts: Sequence[RLPrompt], n: int) -> list[RolloutSample]:
        """Sample ``n`` responses per prompt; see :class:`RolloutEngine` for the order. A prompt's
        ``response_prefix`` is appended to its input for decoding and leads each of its responses."""
        if n < 1:
            raise KeyeConfigError(f"n (rollouts per prompt) must be >= 1, got {n}")
        if not prompts:
            return []
        inputs = self.prepare(prompts)
        prefixes = [prefix_ids(self.processor, p) for p in prompts]
        decode_in = [pin if pre is None else dataclasses.replace(pin, input_ids=torch.cat([pin.input_ids, pre]))
                     for pin, pre in zip(inputs, prefixes)]
        flat = [i for i in range(len(prompts)) for _ in range(n)]
        was_training = self.model.training
        self.model.eval()
        samples: list[RolloutSample] = []
        try:
            for s in range(0, len(flat), self.max_batch_size):
                chunk = flat[s : s + self.max_batch_size]
                toks, lps = self._decode([decode_in[i] for i in chunk])
                lengths = response_lengths(toks, self.eos_ids)
                for i, row, lp, k in zip(chunk, toks, lps, lengths.tolist()):
                    ids, logp = row[:k].clone(), lp[:k].clone()
                    finished = bool(k > 0 and int(ids[-1]) in self.eos_ids)
                    if prefixes[i] is not None:
                        ids = torch.cat([prefixes[i], ids])
                        logp = torch.cat([torch.zeros(len(prefixes[i]), dtype=logp.dtype), logp])
                    samples.append(RolloutSample(
                        prompt=prompts[i], group=i, inputs=inputs[i], response_ids=ids,
                        text=self.processor.decode(ids, skip_special_tokens=True), finished=finished,
                        rollout_logp=logp, metadata={"mode": prompts[i].mode},
                    ))
        finally:
            self.model.train(was_training)
        return samples


class VLLMRollout:
    """Rollouts with vLLM (``vllm.LLM``) on a GPU host; the trainer's weights are pushed in by name.

    Requests. vLLM's Keye models (``keye.py``, ``keye_vl1_5.py``) take ``multi_modal_data`` as raw media and
    run the checkpoint's own processor on it: their data parser accepts pre-computed *embeddings* only
    (``image_embeds`` / ``video_embeds`` dicts, which the processing path then refuses), never pixel tensors.
    So each prompt becomes ``{"prompt": <rendered chat template, one <|image_pad|> / <|video_pad|> per item>,
    "multi_modal_data": {"image": [PIL images], "video": [uint8 [T, H, W, 3] frames]}}`` with the images and
    frames fetched exactly as :meth:`prepare` fetches them (item size limits, the checkpoint's video defaults),
    plus ``mm_processor_kwargs``: the preview's sampled ``fps`` per video (its time positions), or the 1.5
    processor's per-video ``frame_types`` (0 slow, 1 fast), ``timestamps``, ``height`` / ``width`` and
    ``fast_height`` / ``fast_width`` as keye-vl-utils returns them (architecture.md §10.4). The training
    side uses our processor's outputs for the same conversation (:meth:`prepare`); the response token ids
    come from vLLM.

    Log-probs. ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob for every step. vLLM's
    default ``logprobs_mode="raw_logprobs"`` scores it under the *raw* logits, before temperature and
    top-k/top-p; when this class builds the engine (vLLM >= 0.10.2) it asks for ``"processed_logprobs"``,
    the distribution actually sampled from, which is what the learner's tempered log-probs and the
    truncated importance-sampling weight (:func:`keye.rl.algorithms.losses.policy_loss`) compare against.

    Weights. :meth:`sync_weights` streams the learner's tensors (HF / official names, which vLLM's Keye
    ``load_weights`` maps itself) into the engine shard by shard. Colocated (``colocate=True``): the engine
    is built with ``enable_sleep_mode=True``; after every ``generate`` it calls ``llm.sleep(level)``
    (level 1 offloads the weights to CPU and frees the KV cache), a sync wakes the weights only
    (``wake_up(tags=["weights"])``, as verl's sharding manager does, so the KV cache is re-allocated after the
    learner has freed its memory) and the next ``generate`` wakes the KV cache.

    Args:
        llm: a constructed ``vllm.LLM`` or a model path/hub id (then ``LLM(model=..., **llm_kwargs)``).
        processor: a :class:`keye.KeyeProcessor` of the same checkpoint.
        sampling: the run's :class:`~keye.rl.rollout.settings.SamplingSettings` (``SamplingParams``, one per
            prompt; ``max_batch_size`` is vLLM's to choose).
        seed: prompt ``k`` of call ``i`` of :meth:`generate` samples with a seed hashed from ``(seed + i, k)`` (the
            call count is in :meth:`state_dict`, so a resumed run repeats the stream).
        colocate: the engine shares its GPU with the learner (sleep after each generate, see above).
        sleep_level: ``llm.sleep`` level when colocated: 1 keeps a CPU copy of the weights, 2 discards
            them (then every generate after a sleep needs a :meth:`sync_weights` first).
        eos_token_id: stop ids sent as ``SamplingParams.stop_token_ids`` (default: vLLM's, from the
            checkpoint's generation config and tokenizer).
        param_shapes: ``{name: shape}`` of every weight the served model takes, for checking syncs
            (default: built on the meta device from the checkpoint's ``config.json`` when the model path is
            a local directory; without it a sync is checked by the engine alone).
        llm_kwargs: passed to ``vllm.LLM`` when ``llm`` is a path (e.g. ``gpu_memory_utilization``).
    Raises:
        KeyeConfigError: when ``vllm`` cannot be imported, or for invalid settings.

    The engine holds its own copy of the weights: ``weight_version`` is the version of the policy it serves
    (0: the checkpoint it was built from; then the ``version`` of the last :meth:`sync_weights`, the
    trainer's step), and every sample's ``metadata["weight_version"]`` records the version that generated
    it. A trainer must sync after every update and, after a resume, before the first rollout.
    """

    def __init__(self, llm: Any, processor: Any, sampling: SamplingSettings | None = None, *, seed: int = 0,
                 colocate: bool = False, sleep_level: int = 1,
                 eos_token_id: int | Sequence[int] | None = None,
                 param_shapes: Mapping[str, Sequence[int]] | None = None, **llm_kwargs: Any):
        try:
            import vllm
        except ImportError as err:
            raise KeyeConfigError(
                "VLLMRollout needs the 'vllm' package (GPU hosts only: pip install vllm); "
                f"it could not be imported ({err}). Use LocalRollout instead."
            ) from None
        stray = sorted(set(llm_kwargs) & {f.name for f in dataclasses.fields(SamplingSettings)})
        if stray:
            raise KeyeConfigError(f"VLLMRollout: {stray} are sampling settings: pass them in sampling=SamplingSettings(...), "
                                  "not as vllm.LLM arguments")
        if sleep_level not in (1, 2):
            raise KeyeConfigError(f"sleep_level must be 1 or 2 (vLLM's sleep levels), got {sleep_level}")
        self._vllm = vllm
        self.colocate = bool(colocate)
        self.sleep_level = int(sleep_level)
        if isinstance(llm, (str, bytes)) or hasattr(llm, "__fspath__"):
            path = os.fsdecode(llm)
            kwargs = dict(llm_kwargs)
            if self.colocate:
                kwargs.setdefault("enable_sleep_mode", True)
            if hasattr(getattr(vllm, "EngineArgs", None), "logprobs_mode"):  # vLLM >= 0.10.2
                kwargs.setdefault("logprobs_mode", "processed_logprobs")
            # An in-process engine core (verl sets the same) lets sync_weights reach the model directly,
            # without serialising every tensor to a worker process.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            self.llm = vllm.LLM(model=path, **kwargs)
        else:
            if llm_kwargs:
                raise KeyeConfigError(f"LLM arguments {sorted(llm_kwargs)} apply only when VLLMRollout builds the "
                                      "engine from a model path; this one is already constructed")
            self.llm = llm
            path = _engine_model_path(llm)
        self.processor = processor
        self.sampling = sampling if sampling is not None else SamplingSettings()
        s = self.sampling
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = s.max_new_tokens, s.temperature, s.top_p, s.top_k
        self.seed = seed
        eos = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_ids = None if eos is None else [int(e) for e in eos]
        if param_shapes is not None:
            self.param_shapes = {k: tuple(int(d) for d in v) for k, v in param_shapes.items()}
        else:
            self.param_shapes = _checkpoint_shapes(path)
        self._calls = 0
        self.weight_version = 0
        self._asleep: set[str] = set()
        self._weights_discarded = False
        self._partial: str | None = None
        self._stale_prefix = False

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

    # -------------------------------------------------------------------------------------------- requests
    def _process(self, prompts: Sequence[RLPrompt]) -> tuple[list[list[dict[str, Any]]], Any, list[PromptInputs]]:
        convs = [_apply_mode(p.messages, p.mode) for p in prompts]
        batch = self.processor(convs, return_tensors="pt")
        merge = self.processor.image_processor.config.merge_size
        return convs, batch, split_batch(batch, self.processor.image_token_id, self.processor.video_token_id, merge)

    def prepare(self, prompts: Sequence[RLPrompt]) -> list[PromptInputs]:
        """Our processor's outputs for the prompts (what the training forward will see)."""
        return self._process(prompts)[2]

    def requests(self, prompts: Sequence[RLPrompt]) -> list[dict[str, Any]]:
        """The ``LLM.generate`` prompt of each of ``prompts`` (see the class doc for the shape)."""
        convs, batch, _ = self._process(prompts)
        return [self._request(conv, [m for m in batch.video_meta if m.row == r]) for r, conv in enumerate(convs)]

    def _request(self, conv: list[dict[str, Any]], video_meta: Sequence[Any]) -> dict[str, Any]:
        from keye.processing.chat import item_kind
        from keye.processing.image import fetch_image
        from keye.processing.video import fetch_video

        proc = self.processor
        images, videos, metas = [], [], iter(video_meta)
        for m in conv:
            if isinstance(m["content"], str):
                continue
            for c in m["content"]:
                kind = item_kind(c)
                if kind == "image":
                    src = c.get("image", c.get("image_url"))
                    src = src.get("url") if isinstance(src, dict) else src
                    images.append(fetch_image(src, proc.variant, min_pixels=c.get("min_pixels"),
                                              max_pixels=c.get("max_pixels"), resized_height=c.get("resized_height"),
                                              resized_width=c.get("resized_width"), item=f"image {len(images)}"))
                elif kind == "video":
                    where = f"video {len(videos)}"
                    v = fetch_video(c.get("video"), proc.video_options(c, item=where), proc.variant,
                                    backend=proc.video_backend, item=where)
                    videos.append((np.ascontiguousarray(v.frames), next(metas)))
        req: dict[str, Any] = {"prompt": proc.chat_template.render(conv, True)}
        mm: dict[str, Any] = {}
        if images:
            mm["image"] = images
        if videos:
            mm["video"] = [frames for frames, _ in videos]
            req["mm_processor_kwargs"] = self._video_kwargs([meta for _, meta in videos])
        if mm:
            req["multi_modal_data"] = mm
        return req

    def _video_kwargs(self, metas: Sequence[Any]) -> dict[str, list[Any]]:
        """The processor kwargs of a prompt's videos, one list entry per video (keye-vl-utils' form)."""
        if self.processor.variant == "preview":
            return {"fps": [float(m.sample_fps) for m in metas]}
        return {
            "frame_types": [torch.tensor([int(t == "fast") for t in m.frame_types], dtype=torch.int32) for m in metas],
            "timestamps": [None if m.timestamps is None else torch.tensor(m.timestamps, dtype=torch.float32)
                           for m in metas],
            "height": [int(m.extra["slow_hw"][0]) for m in metas],
            "width": [int(m.extra["slow_hw"][1]) for m in metas],
            "fast_height": [int(m.extra["fast_hw"][0]) for m in metas],
            "fast_width": [int(m.extra["fast_hw"][1]) for m in metas],
        }

    # -------------------------------------------------------------------------------------------- sleeping
    def _wake(self, tags: Sequence[str]) -> None:
        todo = [t for t in tags if t in self._asleep]
        if not todo:
            return
        if "tags" in inspect.signature(self.llm.wake_up).parameters:
            self.llm.wake_up(tags=todo)
        else:  # vLLM before tagged wake-up: everything at once
            self.llm.wake_up()
            todo = list(self._asleep)
        self._asleep.difference_update(todo)

    def _sleep(self) -> None:
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_discarded = self.sleep_level == 2

    # -------------------------------------------------------------------------------------------- generate
    def generate(self, prompts: Sequence[RLPrompt], n: int) -> list[RolloutSample]:
        """Sample ``n`` responses per prompt with ``LLM.generate``; order as in :class:`RolloutEngine`.

        Each sample's ``rollout_logp`` holds the engine's log-probs of its tokens (None if the engine
        returned none) and ``metadata["weight_version"]`` the weight version that generated it.

        Raises:
            KeyeConfigError: the engine holds a partial weight update (a failed sync) or, after a level-2
                sleep, no weights at all.
        """
        if n < 1:
            raise KeyeConfigError(f"n (rollouts per prompt) must be >= 1, got {n}")
        if self._partial is not None:
            raise KeyeConfigError(f"the vLLM engine holds a partial weight update ({self._partial}); "
                                  "sync the weights again before generating")
        if self._weights_discarded:
            raise KeyeConfigError("the vLLM engine discarded its weights in a level-2 sleep; sync_weights must load "
                                  "them before the next generate")
        if not prompts:
            return []
        convs, batch, inputs = self._process(prompts)
        reqs = [self._request(conv, [m for m in batch.video_meta if m.row == r]) for r, conv in enumerate(convs)]
        prefixes = [prefix_ids(self.processor, p) for p in prompts]
        for req, p in zip(reqs, prompts):
            if p.response_prefix is not None:  # decoding continues after the forced text
                req["prompt"] += p.response_prefix
        # One SamplingParams per prompt: vLLM seeds child j of a request with seed + j, so a single seed shared
        # by every prompt would draw the same random stream for all of them.
        seeds = [_prompt_seed(self.seed + self._calls, i) for i in range(len(prompts))]
        params = [self._vllm.SamplingParams(
            n=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k if self.top_k > 0 else -1,
            max_tokens=self.max_new_tokens, seed=seed, logprobs=0,
            **({"stop_token_ids": list(self.eos_ids)} if self.eos_ids is not None else {}),
        ) for seed in seeds]
        self._calls += 1
        self._wake(("weights", "kv_cache"))
        if self._stale_prefix and hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the previous weights
        self._stale_prefix = False
        outputs = self.llm.generate(reqs, params, use_tqdm=False)
        if self.colocate:
            self._sleep()
        if len(outputs) != len(prompts):
            raise KeyeInputError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        samples = []
        for i, out in enumerate(outputs):
            if len(out.outputs) != n:
                raise KeyeInputError(f"vLLM returned {len(out.outputs)} completions for prompt {prompts[i].id!r}, "
                                     f"asked for {n}")
            for comp in out.outputs:
                ids = torch.tensor(list(comp.token_ids), dtype=torch.long)
                text, logp = comp.text, _completion_logprobs(comp, prompts[i].id)
                if prefixes[i] is not None:
                    ids, text = torch.cat([prefixes[i], ids]), prompts[i].response_prefix + text
                    if logp is not None:
                        logp = torch.cat([torch.zeros(len(prefixes[i]), dtype=logp.dtype), logp])
                samples.append(RolloutSample(
                    prompt=prompts[i], group=i, inputs=inputs[i], response_ids=ids, text=text,
                    finished=comp.finish_reason == "stop", rollout_logp=logp,
                    metadata={"mode": prompts[i].mode, "weight_version": self.weight_version, "engine_seed": seeds[i]},
                ))
        return samples

    # ------------------------------------------------------------------------------------------------ sync
    def sync_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[Any], version: int | None = None) -> int:
        """Load the trainer's weights into the served model by (official) name; returns the tensor count.

        ``weights``: a state dict, an iterable of ``(name, tensor)`` pairs, or an iterable of ``{name:
        tensor}`` shards (e.g. the learner's bounded-size export); it is consumed lazily, one shard at a
        time, so the full model never has to exist at once. Every tensor goes to the model's
        ``load_weights`` (vLLM's Keye models map the official names to their fused modules): directly when
        the engine runs in this process (``llm.llm_engine.model_executor.driver_worker.worker.model_runner
        .model``, verl's path with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else through ``LLM.apply_model``
        (vLLM >= 0.7; with a multi-process V1 engine this needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``),
        one call per shard. Colocated, the weights are woken first (not the KV cache). ``weight_version``
        becomes ``version`` (default: the previous version + 1) once every shard is in.

        Raises:
            KeyeInputError: an item that is neither a pair nor a shard; a name the served model does not
                have, a wrong shape, a tensor sent twice, or (with known shapes) weights never sent, naming
                the tensor. When this happens after some shards were loaded the engine holds a partial update
                and :meth:`generate` refuses to run until a sync succeeds.
        """
        load = self._loader()
        self._wake(("weights",))
        shapes = self.param_shapes
        seen: set[str] = set()
        for s, shard in enumerate(_weight_shards(weights)):
            for name, tensor in shard:
                where = f"weight sync: tensor {name!r} (shard {s})"
                if name in seen:
                    raise KeyeInputError(f"{where} was sent twice")
                if shapes is not None:
                    if name not in shapes:
                        raise KeyeInputError(f"{where} is not a weight of the served model")
                    if tuple(tensor.shape) != shapes[name]:
                        raise KeyeInputError(f"{where} has shape {tuple(tensor.shape)}, the served model's is "
                                             f"{shapes[name]}")
                seen.add(name)
            try:
                load(shard)
            except (KeyError, ValueError, AssertionError, RuntimeError) as err:
                self._partial = f"shard {s} failed"
                raise KeyeInputError(f"weight sync: the engine refused shard {s} "
                                     f"({[n for n, _ in shard][:3]}...): {err}") from err
            self._partial = f"{len(seen)} tensors loaded before the sync stopped"
        if shapes is not None and len(seen) < len(shapes):
            missing = sorted(set(shapes) - seen)
            raise KeyeInputError(f"weight sync: {len(missing)} weights of the served model were never sent, e.g. "
                                 f"{missing[:3]}")
        self._partial = None
        self._weights_discarded = False
        self._stale_prefix = True
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return len(seen)

    def load_weights(self, shards: Mapping[str, torch.Tensor] | Iterable[Any], version: int | None = None) -> int:
        """:meth:`sync_weights` under :class:`LocalRollout`'s name for the same operation."""
        return self.sync_weights(shards, version)

    def _loader(self) -> Any:
        model = _in_process_model(self.llm)
        if model is not None:
            return model.load_weights
        if hasattr(self.llm, "apply_model"):
            return lambda shard: self.llm.apply_model(functools.partial(_load_into_model, shard))
        raise KeyeConfigError("cannot reach the vLLM engine's model to load weights: the LLM has neither an "
                              "in-process driver worker nor apply_model (vLLM >= 0.7 is needed)")


def _prompt_seed(call_seed: int, index: int) -> int:
    """A 48-bit sampling seed for prompt ``index`` of the call seeded ``call_seed`` (deterministic, so a resumed
    run repeats it; hashed, so that ``seed + j`` of one prompt's children never meets another prompt's)."""
    digest = hashlib.blake2b(f"{call_seed}:{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little")


def _load_into_model(shard: list[tuple[str, torch.Tensor]], model: Any) -> int:
    """Runs in vLLM's worker (``LLM.apply_model``): a module-level function, so that it can be pickled."""
    model.load_weights(shard)
    return len(shard)


def _in_process_model(llm: Any) -> Any:
    """The model object of an engine running in this process, or None (multi-process engine)."""
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    driver = getattr(executor, "driver_worker", None)
    for holder in (getattr(driver, "worker", None), driver):  # V1 wraps the worker; V0 is the worker
        model = getattr(getattr(holder, "model_runner", None), "model", None)
        if model is not None and hasattr(model, "load_weights"):
            return model
    return None


def _engine_model_path(llm: Any) -> str | None:
    """The model path a constructed ``vllm.LLM`` was built from (``llm_engine.model_config.model``)."""
    path = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "model", None)
    return path if isinstance(path, str) else None


def _checkpoint_shapes(path: str | None) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of the state dict of the model at a local checkpoint path (built on the meta
    device: no memory), or None when ``path`` is not a local checkpoint directory."""
    if path is None or not (Path(path) / "config.json").is_file():
        return None
    from keye.config import KeyeVLConfig
    from keye.model.keye_vl import KeyeVL

    config = KeyeVLConfig.from_json_file(path)
    with torch.device("meta"):
        model = KeyeVL(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _weight_shards(weights: Any) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Normalise sync input to a stream of shards ``[(name, tensor), ...]``: a state dict is one shard, a
    ``{name: tensor}`` item one shard each, a ``(name, tensor)`` pair a shard of its own."""
    if isinstance(weights, Mapping):
        yield [(str(k), v.detach()) for k, v in weights.items()]
        return
    for k, item in enumerate(weights):
        if isinstance(item, Mapping):
            yield [(str(name), t.detach()) for name, t in item.items()]
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str) \
                and isinstance(item[1], torch.Tensor):
            yield [(item[0], item[1].detach())]
        else:
            raise KeyeInputError(f"weight sync: item {k} is a {type(item).__name__}; weights must be a state dict, "
                                 "(name, tensor) pairs or {name: tensor} shards")


def _completion_logprobs(comp: Any, prompt_id: str) -> torch.Tensor | None:
    """float32 [n] log-probs of a completion's sampled tokens (vLLM: one ``{token_id: Logprob}`` per step)."""
    if not comp.logprobs:
        return None
    ids = list(comp.token_ids)
    if len(comp.logprobs) != len(ids):
        raise KeyeInputError(f"prompt {prompt_id!r}: vLLM returned {len(comp.logprobs)} log-prob steps for "
                             f"{len(ids)} tokens")
    try:
        return torch.tensor([step[int(t)].logprob for step, t in zip(comp.logprobs, ids)], dtype=torch.float32)
    except KeyError as err:
        raise KeyeInputError(f"prompt {prompt_id!r}: vLLM's log-probs lack the sampled token {err}") from None


