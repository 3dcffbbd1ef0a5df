"""A streaming rollout worker over a whole :class:`keye.KeyeVL`: the real engine behind asynchronous RL.

:class:`StreamWorker` implements :class:`keye.rl.rollout.rollout_manager.RolloutWorker`. It holds any number of
requests (:class:`keye.rl.rollout.trajectory.Request`: a prompt, the answer tokens generated so far, an attempt
number) and decodes them together with the KV cache, a *chunk* of ``chunk_tokens`` tokens at a time:

* a request joins the running batch between chunks: its prompt and the tokens it already has are prefilled
  on their own and their cache is merged into the batch's (left-padded, with per-row rotary offsets), so
  the rows already decoding keep their caches (continuous batching);
* each sampled token's *behaviour* log-prob is recorded under the distribution it was drawn from (tempered,
  then top-k / top-p filtered, as :class:`keye.rl.rollout.engines.LocalRollout` records ``rollout_logp``), together
  with the weight version that sampled it (:class:`~keye.rl.rollout.rollout_manager.TokenChunk`);
* :meth:`StreamWorker.load_weights` runs between chunks only (never inside one: a chunk, hence a token,
  never mixes versions); the caches computed with the old weights are dropped and every unfinished answer is
  prefilled again (prompt + its tokens so far) under the new weights before it continues - a *partial
  rollout* whose tokens carry the version that sampled each of them.

With ``background=True`` a thread decodes whenever there is work and the worker is not paused, and
:meth:`StreamWorker.poll` only collects what it produced (generation then overlaps whatever the caller does,
e.g. training); otherwise every :meth:`StreamWorker.poll` decodes one chunk first (deterministic, for tests).

The same worker as a Ray actor, and the driver-side adapter the rollout manager drives, are in
:mod:`keye.rl.distributed.stream_workers`.

Requests carry their prompt in the group ``meta``: ``meta["messages"]`` (the conversation up to the user
turn, as in :class:`keye.rl.rollout.samples.RLPrompt`) and ``meta["mode"]`` (thinking mode or None); the worker
processes it with its own processor (cached per group), exactly as the trainer does, so both see the same
token ids and pixels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from keye.errors import KeyeConfigError, KeyeError, KeyeInputError
from keye.rl.rollout.rollout_manager import Finished, TokenChunk
from keye.rl.rollout.samples import PromptInputs, collate_prompts, split_batch
from keye.rl.rollout.settings import SamplingSettings
from keye.rl.rollout.trajectory import Request
from keye.train.models import load_weight_shards

log = logging.getLogger(__name__)

META_MESSAGES = "messages"
META_MODE = "mode"
RAY_CALL_TIMEOUT_S = 600.0
"""Longest a driver waits for one call on a rollout actor (model loading on first use included) before it
declares the actor dead."""


class WorkerFailed(KeyeError, RuntimeError):
    """The worker cannot serve any more (its decoding thread failed, it was closed, or its actor died)."""


# ------------------------------------------------------------------------------------- answer lengths
@dataclass(frozen=True)
class AnswerLengths:
    """Long-tailed answer lengths for benchmarks and tests: the answer of ``(prompt_id, sample)`` is
    ``round(exp(N(mu, sigma)))`` tokens, clipped to ``[1, max_tokens]``, a fixed function of the pair and
    ``seed`` (the same answer keeps its length across workers, restarts and weight updates).

    Given to :class:`StreamWorker` as ``answer_length``: the EOS ids are masked out of the sampling
    distribution until the answer has that many tokens and the answer is cut there (finish reason
    ``"length"``); the recorded behaviour log-probs are those of the masked distribution actually sampled.
    """

    mu: float
    sigma: float
    max_tokens: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.sigma < 0:
            raise KeyeConfigError(f"answer lengths need max_tokens >= 1 and sigma >= 0, got {self.max_tokens}, "
                                  f"{self.sigma}")

    def __call__(self, prompt_id: str, sample: int) -> int:
        """The length (tokens, EOS slot included) of answer ``sample`` of ``prompt_id``."""
        h = hashlib.blake2b(f"{self.seed}/{prompt_id}/{sample}".encode(), digest_size=8).digest()
        z = float(np.random.default_rng(int.from_bytes(h, "little")).standard_normal())
        return int(min(self.max_tokens, max(1, round(math.exp(self.mu + self.sigma * z)))))


# ------------------------------------------------------------------------------------------- the worker
@dataclass
class _Row:
    req: Request
    inputs: PromptInputs
    tokens: list[int]  # the whole answer so far: the request's tokens, then those sampled here
    budget: int  # tokens this worker may still add
    eos_from: int  # answer length (tokens) from which an EOS may be sampled


@dataclass
class _Batch:
    """Rows decoding together: their KV cache (left-padded to one length), key mask [B, L], rotary offsets
    [B, 1] (next position = cache length + offset) and the next-token logits [B, V]."""

    rows: list[_Row]
    cache: Any
    attn: torch.Tensor
    rope: torch.Tensor
    logits: torch.Tensor


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if n == 0 else torch.nn.functional.pad(t, (0, 0, n, 0))


class StreamWorker:
    """Chunked, versioned, continuous-batching sampling with a whole KeyeVL (module doc).

    Args:
        model: a :class:`keye.KeyeVL` with whole weights (used under ``no_grad`` in eval mode).
        processor: a :class:`keye.KeyeProcessor` (prompts are processed here, cached per group).
        sampling: the run's :class:`~keye.rl.rollout.settings.SamplingSettings`: ``max_new_tokens`` is the answer
            budget when a request carries none, the recorded log-probs are under its distribution (temperature,
            top-p, top-k) and ``max_batch_size`` rows are decoded together (further requests wait).
        chunk_tokens: tokens decoded per chunk (the granularity of pauses and weight loads).
        seed: seeds the sampling generator.
        version: weight version the model holds at construction.
        eos_token_id: stop ids (default: the model config's).
        answer_length: ``answer_length(prompt_id, sample) -> n``: EOS masked until the answer has ``n``
            tokens, cut at ``n`` (:class:`AnswerLengths`); None: the model decides.
        background: decode in a thread (see module doc).
        prompt_cache: processed prompts kept (per group id).
    """

    def __init__(self, model: torch.nn.Module, processor: Any, sampling: SamplingSettings | None = None, *,
                 chunk_tokens: int = 4, seed: int = 0, version: int = 0, eos_token_id: int | Sequence[int] | None = None,
                 answer_length: Callable[[str, int], int] | None = None, background: bool = False,
                 prompt_cache: int = 256):
        if chunk_tokens < 1:
            raise KeyeConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        s = self.sampling = sampling if sampling is not None else SamplingSettings()
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.max_new_tokens = s.max_new_tokens
        self.temperature, self.top_p, self.top_k = float(s.temperature), float(s.top_p), int(s.top_k)
        self.chunk_tokens = chunk_tokens
        self.max_batch = s.max_batch_size
        self.version = int(version)
        eos = model.config.eos_token_ids if eos_token_id is None else eos_token_id
        self.eos_ids = [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        self.pad_id = int(processor.pad_token_id)
        self.placeholders = [int(getattr(model.config, k)) for k in ("image_token_id", "video_token_id")
                             if getattr(model.config, k, None) is not None]
        self.answer_length = answer_length
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self._prompts: OrderedDict[int, PromptInputs] = OrderedDict()
        self._prompt_cache = prompt_cache
        self._pending: list[_Row] = []
        self._batch: _Batch | None = None
        self._events: list[TokenChunk | Finished] = []
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiting = 0  # callers waiting for the lock (the decoding thread lets them in between chunks)
        self._waiting_lock = threading.Lock()
        self.counts = {"requests": 0, "chunks": 0, "tokens": 0, "prefill_tokens": 0, "prefills": 0,
                       "reprefilled_rows": 0, "weight_loads": 0, "finished": 0, "merges": 0, "trims": 0}
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="keye-stream-worker", daemon=True)
            self._thread.start()

    # -------------------------------------------------------------------------------------- locking
    @contextmanager
    def _locked(self):
        with self._waiting_lock:
            self._waiting += 1
        with self._cond:
            with self._waiting_lock:
                self._waiting -= 1
            if self._error is not None:
                raise WorkerFailed(f"the rollout worker failed: {self._error!r}") from self._error
            if self._closed:
                raise WorkerFailed("the rollout worker was closed")
            yield

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or not (self._pending or self._batch)):
                    self._cond.wait()
                if self._closed:
                    return
                try:
                    self._chunk()
                except BaseException as err:  # noqa: BLE001 - reported by every later call
                    log.exception("rollout worker decoding failed")
                    self._error = err
                    self._cond.notify_all()
                    return
            # the lock is not fair: let callers that queued during the chunk in before the next one
            while self._waiting:
                time.sleep(0.0002)

    # ------------------------------------------------------------------------------------- protocol
    def alive(self) -> bool:
        """False once the decoding thread failed or the worker was closed."""
        return self._error is None and not self._closed

    def submit(self, requests: Sequence[Request]) -> None:
        """Take the requests (each continues its ``tokens``); a request already ending with an EOS, or with
        no budget left, is reported finished on the next poll without sampling.

        Raises:
            KeyeInputError: a request without ``meta["messages"]``, or a trajectory id already held.
        """
        rows = [self._row(r) for r in requests]  # prompt processing outside the lock: decoding goes on
        with self._locked():
            held = {r.req.traj_id for r in self._pending} | (
                {r.req.traj_id for r in self._batch.rows} if self._batch else set())
            for row in rows:
                if row.req.traj_id in held:
                    raise KeyeInputError(f"trajectory {row.req.traj_id} submitted twice to one rollout worker")
                self.counts["requests"] += 1
                if row.tokens and row.tokens[-1] in self.eos_ids:
                    self._finish(row, "stop")
                elif row.budget <= 0:
                    self._finish(row, "length")
                else:
                    self._pending.append(row)
            self._cond.notify_all()

    def poll(self) -> list[TokenChunk | Finished]:
        """The events produced since the last poll (without a background thread: decode one chunk first,
        unless paused)."""
        with self._locked():
            if self._thread is None and not self._paused:
                self._chunk()
            out, self._events = self._events, []
            return out

    def pause(self) -> None:
        """Stop at a chunk boundary: once this returns, no token is sampled until :meth:`resume`."""
        with self._locked():
            self._paused = True

    def resume(self) -> None:
        """Continue the held requests."""
        with self._locked():
            self._paused = False
            self._cond.notify_all()

    def load_weights(self, shards: Iterable[Mapping[str, torch.Tensor]], version: int) -> int:
        """Load whole-weight shards ``{name: tensor}`` (every weight exactly once, see
        :func:`keye.rl.rollout.engines.load_weight_shards`) between chunks and serve ``version`` from now on; the
        unfinished answers are prefilled again under the new weights before they continue. Returns the
        number of tensors loaded."""
        with self._locked():
            n = load_weight_shards(self.model, shards)
            self.version = int(version)
            self.counts["weight_loads"] += 1
            if self._batch is not None:
                # the cache holds keys / values of the old weights: recompute every prefix
                self.counts["reprefilled_rows"] += len(self._batch.rows)
                self._pending = self._batch.rows + self._pending
                self._batch = None
            return n

    def close(self) -> None:
        """Stop the decoding thread; later calls raise :class:`WorkerFailed`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def held(self) -> int:
        """Requests held (decoding or waiting for a batch slot)."""
        with self._locked():
            return len(self._pending) + (len(self._batch.rows) if self._batch else 0)

    def pid(self) -> int:
        """The process id (a test kills a worker by it)."""
        return os.getpid()

    # ------------------------------------------------------------------------------------ internals
    def _inputs(self, req: Request) -> PromptInputs:
        cached = self._prompts.get(req.group)
        if cached is not None:
            self._prompts.move_to_end(req.group)
            return cached
        messages = req.meta.get(META_MESSAGES)
        if not isinstance(messages, list) or not messages:
            raise KeyeInputError(f"trajectory {req.traj_id}: the request meta has no {META_MESSAGES!r} (the "
                                 "conversation to answer)")
        from keye.processing.chat import apply_mode

        batch = self.processor([apply_mode(messages, req.meta.get(META_MODE))], return_tensors="pt")
        inputs = split_batch(batch, self.processor.image_token_id, self.processor.video_token_id,
                             self.processor.image_processor.config.merge_size)[0]
        self._prompts[req.group] = inputs
        while len(self._prompts) > self._prompt_cache:
            self._prompts.popitem(last=False)
        return inputs

    def _row(self, req: Request) -> _Row:
        budget = self.max_new_tokens if req.max_new_tokens is None else int(req.max_new_tokens)
        eos_from = 0
        if self.answer_length is not None:
            n = int(self.answer_length(req.prompt_id, req.sample))
            budget = min(budget, n - len(req.tokens))
            eos_from = n
        return _Row(req, self._inputs(req), [int(t) for t in req.tokens], budget, eos_from)

    def _finish(self, row: _Row, reason: str) -> None:
        self._events.append(Finished(row.req.traj_id, row.req.attempt, reason))
        self.counts["finished"] += 1

    @torch.no_grad()
    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Prompt + answer-so-far of ``rows`` through the current weights: a batch with its own cache."""
        from keye.model.text import KVCache
        from keye.train.logprobs import model_inputs

        items = [dataclasses.replace(r.inputs, input_ids=torch.cat([r.inputs.input_ids,
                                                                     torch.tensor(r.tokens, dtype=torch.long)]))
                 for r in rows]
        batch = collate_prompts(items, self.pad_id)
        ids, attn = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        width = ids.shape[1]
        text_mask = torch.zeros_like(ids, dtype=torch.bool)
        if self.placeholders:
            ph = torch.tensor(self.placeholders, dtype=torch.long, device=self.device)
            for i, r in enumerate(rows):
                if r.tokens:  # sampled placeholder ids were text when they were decoded
                    start = width - len(r.tokens)
                    text_mask[i, start:] = torch.isin(ids[i, start:], ph)
        cache = KVCache(len(self.model.model.layers), capacity=width + self.chunk_tokens * 8)
        out = self.model(ids, attention_mask=attn, past_key_values=cache, use_cache=True, logits_to_keep=1,
                         text_token_mask=text_mask if bool(text_mask.any()) else None,
                         **model_inputs(batch, self.device, self.model.dtype))
        self.counts["prefills"] += 1
        self.counts["prefill_tokens"] += int(attn.sum())
        return _Batch(list(rows), cache, attn, out.rope_deltas, out.logits[:, -1].float())

    @staticmethod
    def _merge(a: _Batch, b: _Batch) -> _Batch:
        """One batch from two: the shorter cache is left-padded (masked keys), its rotary offsets shifted so
        each row's next position is unchanged."""
        la, lb = a.cache.length, b.cache.length
        length = max(la, lb)
        cache = a.cache
        for i in range(cache.num_layers):
            cache.keys[i] = torch.cat([_pad_left(a.cache.keys[i][:, :, :la], length - la),
                                       _pad_left(b.cache.keys[i][:, :, :lb], length - lb)], 0)
            cache.values[i] = torch.cat([_pad_left(a.cache.values[i][:, :, :la], length - la),
                                         _pad_left(b.cache.values[i][:, :, :lb], length - lb)], 0)
        cache.length = length
        attn = torch.cat([_pad_left(a.attn[..., None], length - la)[..., 0],
                          _pad_left(b.attn[..., None], length - lb)[..., 0]], 0)
        rope = torch.cat([a.rope - (length - la), b.rope - (length - lb)], 0)
        return _Batch(a.rows + b.rows, cache, attn, rope, torch.cat([a.logits, b.logits], 0))

    @staticmethod
    def _keep(batch: _Batch, keep: list[int]) -> _Batch:
        """Only rows ``keep`` (positions), with the key columns that every kept row masks trimmed away."""
        index = torch.tensor(keep, dtype=torch.long, device=batch.attn.device)
        batch.cache.reorder(index)
        attn, rope = batch.attn[index], batch.rope[index]
        lead = int((attn.cumsum(1) == 0).sum(1).min())
        if lead:
            c = batch.cache
            for i in range(c.num_layers):
                c.keys[i] = c.keys[i][:, :, lead:]
                c.values[i] = c.values[i][:, :, lead:]
            c.length -= lead
            attn, rope = attn[:, lead:], rope + lead
        return _Batch([batch.rows[i] for i in keep], batch.cache, attn, rope, batch.logits[index])

    def _admit(self) -> None:
        room = self.max_batch - (len(self._batch.rows) if self._batch else 0)
        if room <= 0 or not self._pending:
            return
        rows, self._pending = self._pending[:room], self._pending[room:]
        fresh = self._prefill(rows)
        if self._batch is None:
            self._batch = fresh
        else:
            self._batch = self._merge(self._batch, fresh)
            self.counts["merges"] += 1

    @torch.no_grad()
    def _chunk(self) -> None:
        """Decode up to ``chunk_tokens`` tokens for every held row under the current weights and queue the
        events (one :class:`TokenChunk` per row that sampled, then :class:`Finished` for those that ended)."""
        self._admit()
        if self._batch is None:
            return
        from keye.model.generation import top_k_top_p_filter

        sampled: dict[int, tuple[_Row, list[int], list[float]]] = {}  # in row order
        ended: list[tuple[_Row, str]] = []
        for _ in range(self.chunk_tokens):
            b = self._batch
            logits = b.logits
            early = [i for i, r in enumerate(b.rows) if len(r.tokens) + 1 < r.eos_from]
            if early and self._eos.numel():
                logits = logits.clone()
                rows_idx = torch.tensor(early, device=logits.device)
                logits[rows_idx[:, None], self._eos[None, :]] = float("-inf")
            lp = torch.log_softmax(top_k_top_p_filter(logits / self.temperature, self.top_k, self.top_p), dim=-1)
            nxt = torch.multinomial(lp.exp(), 1, generator=self.generator).squeeze(1)
            tok_lp = lp.gather(1, nxt[:, None]).squeeze(1)
            keep = []
            for i, (row, t, p) in enumerate(zip(b.rows, nxt.tolist(), tok_lp.tolist())):
                row.tokens.append(int(t))
                row.budget -= 1
                _, toks, lps = sampled.setdefault(row.req.traj_id, (row, [], []))
                toks.append(int(t))
                lps.append(float(p))
                if int(t) in self.eos_ids:
                    ended.append((row, "stop"))
                elif row.budget <= 0:
                    ended.append((row, "length"))
                else:
                    keep.append(i)
            self.counts["tokens"] += len(b.rows)
            if len(keep) < len(b.rows):
                if not keep:
                    self._batch = None
                    break
                width = b.attn.shape[1]
                b = self._batch = self._keep(b, keep)
                self.counts["trims"] += b.attn.shape[1] < width
                nxt = nxt[torch.tensor(keep, device=nxt.device)]
            attn = torch.cat([b.attn, torch.ones_like(b.attn[:, :1])], 1)
            out = self.model(nxt[:, None], attention_mask=attn, past_key_values=b.cache, use_cache=True,
                             rope_deltas=b.rope)
            b.attn, b.logits = attn, out.logits[:, -1].float()
        self.counts["chunks"] += 1
        for tid, (row, toks, lps) in sampled.items():
            self._events.append(TokenChunk(tid, row.req.attempt, tuple(toks), tuple(lps), self.version))
        for row, reason in ended:
            self._finish(row, reason)


