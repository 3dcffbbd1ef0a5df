"""Batched generation for the server: one model thread, concurrent requests merged into left-padded batches.

Each request is preprocessed on its own (media fetched, the processor run) by the HTTP handler, so a bad
input fails only that request. The engine's thread then collects what arrives within a short window
(``batch_window_ms``, up to ``max_batch_size`` rows, a request with ``n`` choices being ``n`` rows), merges
compatible requests (same sampling settings; a seeded request runs alone, so its output depends only on
its seed) into one left-padded batch (a greedy request with ``n`` choices is decoded once and its answer
given to every choice, as OpenAI does: greedy choices are identical), and decodes them together with the KV cache. Tokens go back to each
request's event queue as they are produced, so streaming and non-streaming requests share batches.

The queue is bounded (``max_queue`` requests waiting): :meth:`BatchEngine.submit` raises a 429
:class:`~keye.serve.errors.APIError` when it is full, so an overloaded server answers at once instead of
piling up work.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from keye.serve.errors import APIError

log = logging.getLogger(__name__)

# Tensor keys of a processed request that are stacked per media item, in row order.
_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass
class EngineConfig:
    """Batching settings: ``max_batch_size`` rows decoded together, ``batch_window_ms`` how long the engine
    waits for more requests once one arrived, ``max_queue`` requests allowed to wait (more get 429)."""

    max_batch_size: int = 8
    batch_window_ms: float = 10.0
    max_queue: int = 64


@dataclass
class Job:
    """One request's work: its processed prompt (``inputs``: tensors of a batch of one row), sampling
    settings, and where its events go.

    Events (passed to ``emit``) are dicts: ``{"type": "token", "choice": i, "token": id}`` per generated
    token, ``{"type": "done", "choice": i, "reason": "stop" | "length", "tokens": [ids], "eos": bool}`` per
    choice (``tokens`` without the end token; ``eos`` whether decoding ended on one), ``{"type": "end"}`` once
    all choices are done, or ``{"type": "error", "error": APIError}``. ``stop_check(choice, token_ids) ->
    bool`` lets the caller end a choice early (stop strings). A greedy job decodes one row whatever ``n`` is
    and sends every event of that row to each of its ``n`` choices.
    """

    inputs: dict[str, torch.Tensor]
    n: int
    max_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    seed: int | None
    emit: Callable[[dict[str, Any]], None]
    stop_check: Callable[[int, list[int]], bool] | None = None
    submitted: float = field(default_factory=time.perf_counter)

    def key(self) -> tuple:
        """Jobs with equal keys may share a batch."""
        if self.seed is not None:
            return ("seeded", id(self))
        if not self.do_sample:
            return ("greedy",)
        return ("sample", self.temperature, self.top_p)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the processed prompt (vision tokens included)."""
        return int(self.inputs["input_ids"].shape[1])

    @property
    def rows(self) -> int:
        """Rows this job decodes: ``n`` when sampling, 1 when greedy (every greedy choice is the same)."""
        return self.n if self.do_sample else 1

    def choices(self, row: int) -> range:
        """The choices that receive the events of the job's decoded ``row``."""
        return range(self.n) if not self.do_sample else range(row, row + 1)


def merge_inputs(rows: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Merge single-row processed prompts into one left-padded batch, as the processor would build it.

    ``input_ids`` / ``attention_mask`` are left-padded with ``pad_token_id`` / 0; media tensors are
    concatenated in row order (images and videos are numbered across the batch, row 0 first).
    """
    longest = max(int(r["input_ids"].shape[1]) for r in rows)
    ids, mask = [], []
    for r in rows:
        if r["input_ids"].shape[0] != 1:
            raise ValueError("merge_inputs takes single-row prompts")
        pad = longest - int(r["input_ids"].shape[1])
        ids.append(torch.cat([r["input_ids"].new_full((1, pad), pad_token_id), r["input_ids"]], dim=1))
        m = r.get("attention_mask", torch.ones_like(r["input_ids"]))
        mask.append(torch.cat([m.new_zeros((1, pad)), m], dim=1))
    out = {"input_ids": torch.cat(ids), "attention_mask": torch.cat(mask)}
    for key in _MEDIA_KEYS:
        parts = [r[key] for r in rows if key in r]
        if parts:
            out[key] = torch.cat(parts)
    unknown = {k for r in rows for k in r} - set(out) - set(_MEDIA_KEYS)
    if unknown:
        raise ValueError(f"merge_inputs does not know how to batch {sorted(unknown)}")
    return out


class BatchEngine:
    """Owns the model's generation thread. Thread-safe :meth:`submit`; :meth:`close` stops the thread.

    ``model`` must provide ``generate_steps(**inputs, generator=..., max_new_tokens=..., do_sample=...,
    temperature=..., top_p=..., eos_token_id=..., pad_token_id=...)`` yielding ``(next_tokens [B], logits)``
    per step (:meth:`keye.KeyeVL.generate_steps`).
    """

    def __init__(self, model: Any, *, eos_token_ids: list[int], pad_token_id: int, config: EngineConfig | None = None):
        self.model = model
        self.eos = set(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.config = config or EngineConfig()
        if self.config.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.config.max_batch_size}")
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=self.config.max_queue)
        self._pending: list[Job] = []  # taken from the queue but not yet run (incompatible or overflow)
        self.stats = {"requests": 0, "batches": 0, "rows": 0, "generated_tokens": 0, "rejected": 0, "errors": 0}
        self._thread = threading.Thread(target=self._run, name="keye-serve-engine", daemon=True)
        self._closed = threading.Event()
        self._thread.start()

    # ------------------------------------------------------------------ public
    def submit(self, job: Job) -> None:
        """Queue ``job``; raises a 429 :class:`APIError` when the queue is full, 503 once closed."""
        if self._closed.is_set():
            raise APIError(503, "the server is shutting down")
        if job.rows > self.config.max_batch_size:
            raise APIError(400, f"n: {job.n} sampled choices exceed the server's batch size "
                           f"{self.config.max_batch_size}", param="n")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.stats["rejected"] += 1
            raise APIError(429, f"the server is busy ({self.config.max_queue} requests waiting); retry later",
                           code="queue_full") from None
        self.stats["requests"] += 1

    def close(self, timeout: float = 5.0) -> None:
        """Stop the generation thread after the batch in progress."""
        self._closed.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # no room for the wake-up marker: the thread is busy and sees _closed after the queued jobs
        self._thread.join(timeout)

    # ------------------------------------------------------------------ thread
    def _next_batch(self) -> list[Job] | None:
        """Block for work, then gather compatible jobs for one batch (None: closing)."""
        if not self._pending:
            first = self._queue.get()
            if first is None:
                return None
            self._pending.append(first)
        deadline = time.perf_counter() + self.config.batch_window_ms / 1000.0
        while True:
            rows = sum(j.rows for j in self._pending if j.key() == self._pending[0].key())
            remaining = deadline - time.perf_counter()
            if rows >= self.config.max_batch_size or remaining <= 0:
                break
            try:
                job = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if job is None:
                self._closed.set()
                break
            self._pending.append(job)
        key = self._pending[0].key()
        batch, rest, rows = [], [], 0
        for job in self._pending:
            if job.key() == key and rows + job.rows <= self.config.max_batch_size:
                batch.append(job)
                rows += job.rows
            else:
                rest.append(job)
        self._pending = rest
        return batch

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                break
            try:
                self._generate(batch)
            except Exception as err:  # noqa: BLE001 - one failed batch must not kill the server
                log.exception("generation failed for a batch of %d requests", len(batch))
                self.stats["errors"] += 1
                api = err if isinstance(err, APIError) else APIError(500, f"generation failed: {err}")
                for job in batch:
                    job.emit({"type": "error", "error": api})
            if self._closed.is_set() and not self._pending and self._queue.empty():
                break
        for job in self._pending:
            job.emit({"type": "error", "error": APIError(503, "the server is shutting down")})

    @torch.inference_mode()
    def _generate(self, batch: list[Job]) -> None:
        owners = [(job, r) for job in batch for r in range(job.rows)]
        inputs = merge_inputs([job.inputs for job, _ in owners], self.pad_token_id)
        device = getattr(self.model, "device", torch.device("cpu"))
        inputs = {k: v.to(device) for k, v in inputs.items()}
        lead = batch[0]
        generator = None
        if lead.do_sample:
            generator = torch.Generator(device=device)
            if lead.seed is not None:
                generator.manual_seed(int(lead.seed))
            else:
                generator.seed()
        self.stats["batches"] += 1
        self.stats["rows"] += len(owners)
        tokens: list[list[int]] = [[] for _ in owners]
        done = [False] * len(owners)
        rows_left = {id(job): job.rows for job in batch}

        def finish(r: int, reason: str, eos: bool) -> None:
            done[r] = True
            job, row = owners[r]
            for choice in job.choices(row):
                job.emit({"type": "done", "choice": choice, "reason": reason, "tokens": list(tokens[r]), "eos": eos})
            rows_left[id(job)] -= 1
            if rows_left[id(job)] == 0:
                job.emit({"type": "end"})

        steps = self.model.generate_steps(
            **inputs, generator=generator, max_new_tokens=max(job.max_tokens for job in batch),
            do_sample=lead.do_sample, temperature=lead.temperature if lead.do_sample else 1.0,
            top_p=lead.top_p if lead.do_sample else 1.0, eos_token_id=sorted(self.eos),
            pad_token_id=self.pad_token_id,
        )
        try:
            for nxt, _ in steps:
                for r, tok in enumerate(nxt.tolist()):
                    if done[r]:
                        continue
                    job, row = owners[r]
                    if tok in self.eos:
                        finish(r, "stop", eos=True)
                        continue
                    tokens[r].append(tok)
                    self.stats["generated_tokens"] += 1
                    for choice in job.choices(row):
                        job.emit({"type": "token", "choice": choice, "token": tok})
                    if job.stop_check is not None and job.stop_check(row, tokens[r]):
                        finish(r, "stop", eos=False)
                    elif len(tokens[r]) >= job.max_tokens:
                        finish(r, "length", eos=False)
                if all(done):
                    break
        finally:
            steps.close()
        for r in range(len(owners)):  # rows the loop ended without an EOS (max_new_tokens)
            if not done[r]:
                finish(r, "length", eos=False)


def threadsafe_emitter(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[dict[str, Any]], None]:
    """An ``emit`` callback that hands events from the engine thread to an asyncio queue on ``loop``."""

    def emit(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(q.put_nowait, event)

    return emit
