"""Batched, resumable, data-parallel inference for the benchmarks.

- :class:`Engine` is the one thing the runner needs from a model: ``generate(conversations, **gen_kwargs)``
  returning one decoded string per conversation. :class:`KeyeEngine` wraps ``KeyeVL`` + ``KeyeProcessor``
  (batched, left-padded, KV-cached ``model.generate``); tests use canned fakes.
- :class:`PredictionStore` (:mod:`keye.data.records`, re-exported here with :func:`read_records`) is an
  append-only JSONL of records keyed by ``id``; a run that crashed is resumed by skipping the ids already
  present (a truncated last line from the crash is dropped).
- :func:`run_inference` shards the items by rank (``i % world_size == rank``) under ``torchrun``; every rank
  appends to its own part file and rank 0 gathers the parts into the final file (:func:`gather_parts`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from keye.data.records import PredictionStore, read_records  # noqa: F401 - read_records is re-exported
from keye.errors import KeyeError, KeyeInputError
from keye.eval.keyechat import post_process

Conversation = list[dict[str, Any]]

# Keye's recommended sampling (generation_config.json of the preview); the official evaluation is greedy.
KEYE_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
GREEDY = {"do_sample": False}


class Engine(Protocol):
    """Anything that answers a batch of conversations."""

    def generate(self, conversations: list[Conversation], **gen_kwargs: Any) -> list[str]:
        """Return one decoded answer per conversation (same order, same length)."""
        ...


class KeyeEngine:
    """Engine over a ``KeyeVL`` model and its ``KeyeProcessor``.

    Args:
        model: a model with ``generate(**batch, max_new_tokens=..., do_sample=..., ...) -> LongTensor [B, L+N]``
            (prompt then new tokens).
        processor: called as ``processor(conversations, return_tensors="pt", mode=mode)`` -> dict of tensors
            (left-padded ``input_ids`` first dimension B), with ``batch_decode(ids, skip_special_tokens=True)``.
        batch_size: conversations per ``model.generate`` call (>= 1).
        max_new_tokens: generation budget per answer.
        do_sample, temperature, top_p, top_k: decoding; greedy by default (the official Keye evaluation),
            see :data:`KEYE_SAMPLING` for Keye's sampling settings. Sampling parameters are only passed when
            ``do_sample`` is true.
        mode: ``"think"``, ``"no_think"``, ``"auto"`` or None, handed to the processor, which appends Keye's
            ``/think`` / ``/no_think`` switch.

    Keyword arguments of :meth:`generate` override these settings for one call. After each call,
    ``last_token_stats`` holds one ``{"reply_tokens", "think_tokens"}`` per answer (see :meth:`generate`),
    which :func:`run_inference` stores in the prediction records.
    """

    def __init__(
        self,
        model: Any,
        processor: Any,
        batch_size: int = 1,
        max_new_tokens: int = 2048,
        do_sample: bool = False,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        mode: str | None = None,
    ):
        if batch_size < 1 or max_new_tokens < 1:
            raise KeyeInputError(
                f"batch_size and max_new_tokens must be >= 1, got {batch_size}, {max_new_tokens}"
            )
        self.model = model
        self.processor = processor
        self.batch_size = batch_size
        self.settings: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "do_sample": do_sample,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
        }
        self.mode = mode
        self.last_token_stats: list[dict[str, int | None]] = []

    def _device(self) -> Any:
        try:
            return next(self.model.parameters()).device
        except (AttributeError, StopIteration):
            return None

    def generate(self, conversations: list[Conversation], **gen_kwargs: Any) -> list[str]:
        """Answer ``conversations`` in chunks of ``batch_size``; returns the decoded new tokens per item.

        Also sets ``last_token_stats``: per answer ``reply_tokens``, the tokens generated up to and including
        the first EOS (the padding of rows that finished early is not counted; a reply cut by the budget
        counts ``max_new_tokens``), and ``think_tokens``, the reply's think block tokenised with the
        processor's tokenizer (0 without a block; None when the processor has no ``tokenizer``).
        """
        import torch

        from keye.eval.modes import reply_stats

        settings = {**self.settings, **gen_kwargs}
        kwargs = {"max_new_tokens": int(settings["max_new_tokens"]), "do_sample": bool(settings["do_sample"])}
        if kwargs["do_sample"]:
            kwargs.update(
                {k: settings[k] for k in ("temperature", "top_p", "top_k") if settings[k] is not None}
            )
        device = self._device()
        eos = set(getattr(getattr(self.model, "config", None), "eos_token_ids", None) or [])
        tokenizer = getattr(self.processor, "tokenizer", None)
        answers: list[str] = []
        stats: list[dict[str, int | None]] = []
        for start in range(0, len(conversations), self.batch_size):
            chunk = conversations[start : start + self.batch_size]
            batch = self.processor(chunk, return_tensors="pt", mode=self.mode)
            batch = {
                k: (v.to(device) if device is not None and hasattr(v, "to") else v)
                for k, v in dict(batch).items()
            }
            with torch.inference_mode():
                ids = self.model.generate(**batch, **kwargs)
            new_tokens = ids[:, batch["input_ids"].shape[1] :]
            decoded = self.processor.batch_decode(new_tokens, skip_special_tokens=True)
            answers.extend(decoded)
            for row, text in zip(new_tokens.tolist(), decoded):
                n = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
                s = reply_stats(text, reply_tokens=n, tokenizer=tokenizer)
                stats.append({"reply_tokens": n, "think_tokens": s["think_tokens"]})
        self.last_token_stats = stats
        return answers


# ------------------------------------------------------------------------------------------ storage


def part_path(out_path: str | Path, rank: int, world_size: int) -> Path:
    """The file rank ``rank`` writes to: ``out_path`` itself for one process, else ``<stem>.rank<r>.jsonl``."""
    out_path = Path(out_path)
    if world_size <= 1:
        return out_path
    return out_path.with_name(f"{out_path.stem}.rank{rank}{out_path.suffix}")


def gather_parts(
    out_path: str | Path, world_size: int, order: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Merge every rank's part file into ``out_path`` (rank 0's job) and delete the parts.

    Records already in ``out_path`` are kept; new ones are appended in ``order`` (item ids) when given.
    Returns the merged ``{id: record}``.
    """
    store = PredictionStore(out_path)
    merged = store.load()
    new: dict[str, dict[str, Any]] = {}
    parts = [part_path(out_path, r, world_size) for r in range(world_size)] if world_size > 1 else []
    for part in parts:
        if part.exists():
            for item_id, rec in PredictionStore(part).load().items():
                if item_id not in merged:
                    new[item_id] = rec
    if order is not None:
        rank_of = {item_id: i for i, item_id in enumerate(order)}
        new = dict(sorted(new.items(), key=lambda kv: rank_of.get(kv[0], len(rank_of))))
    store.append(new.values())
    for part in parts:
        if part.exists():
            part.unlink()
    merged.update(new)
    return merged


# ------------------------------------------------------------------------------------- distribution


def dist_info() -> tuple[int, int]:
    """Return ``(rank, world_size)``: from ``torch.distributed`` when initialised, else ``RANK`` /
    ``WORLD_SIZE`` environment variables (set by torchrun), else ``(0, 1)``."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed() -> tuple[int, int]:
    """Initialise ``torch.distributed`` when launched by torchrun with several processes (NCCL on GPU, gloo
    on CPU; the CUDA device is ``LOCAL_RANK``); returns ``(rank, world_size)``."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist_info()


def _barrier() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
    except ImportError:
        pass


# ---------------------------------------------------------------------------------------- the loop


def run_inference(
    items: Sequence[Mapping[str, Any]],
    *,
    engine: Engine,
    to_conversation: Callable[[Mapping[str, Any]], Conversation],
    to_record: Callable[[Mapping[str, Any], str, str], dict[str, Any]],
    out_path: str | Path,
    batch_size: int = 8,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    gen_kwargs: Mapping[str, Any] | None = None,
    postprocess: Callable[[str], str] = post_process,
) -> list[dict[str, Any]]:
    """Answer every item not yet in ``out_path`` and append its record; return the records of ``items``.

    Args:
        items: dicts with a unique ``id`` (plus whatever ``to_conversation`` / ``to_record`` read).
        engine: answers conversations (see :class:`Engine`).
        to_conversation: item -> conversation (qwen-vl-utils schema).
        to_record: ``(item, raw_output, post_processed) -> record`` (JSON-serialisable, with ``id``).
        out_path: the predictions JSONL; records already there (or in part files of a crashed multi-rank
            run) are skipped, which makes the run resumable.
        batch_size: items handed to ``engine.generate`` per call; a batch's records are written together.
        rank, world_size: data-parallel position (default: :func:`dist_info`). Rank r answers items
            ``i % world_size == r``; after a barrier rank 0 gathers the part files into ``out_path``.
        progress: show a tqdm bar (rank 0 only).
        gen_kwargs: extra keyword arguments for ``engine.generate``.
        postprocess: raw output -> response the scorers see (Keye's post-processing by default).

    When the engine exposes ``last_token_stats`` (one dict per answer of its last ``generate`` call, as
    :class:`KeyeEngine` does), each record also gets those fields (``reply_tokens``, ``think_tokens``), which
    the per-mode breakdown (:mod:`keye.eval.modes`) reads.

    Returns:
        On rank 0 (or a single process): the records of all ``items`` present in ``out_path``, in item order.
        On other ranks: the records this rank wrote.

    Raises:
        KeyeInputError: duplicate item ids, an item without id, or an engine returning the wrong number of
            answers.
    """
    if rank is None or world_size is None:
        rank, world_size = dist_info()
    ids = []
    for n, item in enumerate(items):
        if "id" not in item:
            raise KeyeInputError("item has no 'id'", item=n)
        ids.append(str(item["id"]))
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise KeyeInputError("duplicate item id", item=dup)
    # Each file is repaired only by its writer (rank 0 owns out_path), so ranks never race on a file.
    done: set[str] = set(PredictionStore(out_path).load(repair=rank == 0))
    if world_size > 1:
        for r in range(world_size):
            if part_path(out_path, r, world_size).exists():
                done.update(PredictionStore(part_path(out_path, r, world_size)).load(repair=r == rank))
    todo = [item for i, item in enumerate(items) if i % world_size == rank and ids[i] not in done]
    store = PredictionStore(part_path(out_path, rank, world_size))
    mine: list[dict[str, Any]] = []
    from tqdm import tqdm

    bar = tqdm(
        total=len(todo),
        desc=f"eval rank {rank}" if world_size > 1 else "eval",
        unit="item",
        disable=not progress or rank != 0,
    )
    try:
        for start in range(0, len(todo), max(1, batch_size)):
            chunk = todo[start : start + max(1, batch_size)]
            conversations = [to_conversation(item) for item in chunk]
            outputs = engine.generate(conversations, **dict(gen_kwargs or {}))
            if len(outputs) != len(chunk):
                raise KeyeInputError(f"engine returned {len(outputs)} answers for {len(chunk)} conversations")
            records = [to_record(item, str(out), postprocess(str(out))) for item, out in zip(chunk, outputs)]
            token_stats = getattr(engine, "last_token_stats", None)
            if isinstance(token_stats, list) and len(token_stats) == len(records):
                for rec, extra in zip(records, token_stats):
                    rec.update(extra)
            store.append(records)
            mine.extend(records)
            bar.update(len(chunk))
    finally:
        bar.close()
    if world_size > 1:
        _barrier()
        if rank == 0:
            gather_parts(out_path, world_size, order=ids)
        _barrier()
        if rank != 0:
            return mine
    stored = PredictionStore(out_path).load()
    return [stored[i] for i in ids if i in stored]


def load_engine(
    model_id: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    **engine_kwargs: Any,
) -> KeyeEngine:
    """Build a :class:`KeyeEngine` from a checkpoint directory or hub id holding the model and processor files
    (``keye.KeyeVL.from_pretrained`` / ``keye.KeyeProcessor.from_pretrained``); ``"keye-tiny"`` names the
    embedded tiny model. The model goes to ``device`` (default: ``cuda:LOCAL_RANK`` when CUDA is available,
    else CPU) in ``dtype`` (``bfloat16``, ``float16``, ``float32``; default: the checkpoint's).

    Raises ``KeyeError`` subclasses from the loaders; an unknown dtype or an unreadable checkpoint raises
    ``KeyeInputError``.
    """
    import torch

    import keye

    if device is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    if dtype is not None and dtype not in ("bfloat16", "float16", "float32"):
        raise KeyeInputError(f"unknown dtype {dtype!r}; expected bfloat16, float16 or float32")
    from keye.hub import resolve_model_path

    model_id = resolve_model_path(model_id)
    try:
        model = keye.KeyeVL.from_pretrained(model_id, torch_dtype=dtype or "auto", device=device)
        processor = keye.KeyeProcessor.from_pretrained(model_id)
    except KeyeError:
        raise
    except OSError as err:
        raise KeyeInputError(f"cannot load model {model_id!r} ({err})") from err
    model.eval()
    return KeyeEngine(model, processor, **engine_kwargs)
