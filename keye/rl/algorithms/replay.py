"""RLEP experience replay (training.md §1.2-1.3, §8.1-8.2).

Phase A (:func:`collect`): sample ``n`` answers per question from a trained policy, keep the verified
successes, keep a question only if it has at least ``min_successes`` (2) distinct successes, store them.
Phase B: :func:`replay_samples` draws ``M`` stored successes per question (uniformly, without replacement;
all of them when the pool holds fewer) and turns them into :class:`RolloutSample` rows of the question's
group. Missing slots are explicit ``valid=False`` rows (no tokens), not empty responses.

Design decisions (left open by the sources, see docs/training.md §8.1-8.2):

- entries store the response token ids when known (the rollout's own ids, first EOS included) and text;
  text-only entries are re-tokenised without special tokens and get the EOS appended, then truncated to
  ``max_response_len`` (the RLEP reference);
- a truncated entry is scored on what is trained: its text becomes the decoded truncated ids (as verl's
  reward manager decodes the response ids it trains on), so a success cut before its answer is scored as
  the failure the trained tokens are, never rewarded for text it does not train on;
- replayed samples get their old log-probs recomputed by the current policy (the trainer does this for all
  samples), so their first importance ratio is 1 as in the reference;
- ``sample`` may restrict to entries recorded in the same thinking mode (``mode=``), so a ``/no_think``
  group is not given ``<think>`` answers; entries without a recorded mode serve every mode.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.rollout.samples import PromptInputs, RLPrompt, RolloutSample

OVERFLOW = ("drop_new", "drop_oldest")


@dataclass
class ReplayEntry:
    """One stored success: ``question_id``, ``response`` text, ``token_ids`` (or None), ``reward`` and
    free ``metadata`` (``mode``, ``source`` = "collect"/"online", ``step``, ...)."""

    question_id: str
    response: str
    token_ids: list[int] | None = None
    reward: float = 1.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        """Dedup key: the token ids when present, else the stripped text."""
        return ("ids", tuple(self.token_ids)) if self.token_ids else ("text", self.response.strip())

    @classmethod
    def from_dict(cls, d: Any, where: str = "entry") -> ReplayEntry:
        """Validate and build from a JSON object; raises :class:`KeyeInputError` naming ``where``."""
        if not isinstance(d, dict):
            raise KeyeInputError(f"{where}: expected a JSON object, got {type(d).__name__}")
        qid, text = d.get("question_id"), d.get("response")
        if not isinstance(qid, (str, int)) or isinstance(qid, bool):
            raise KeyeInputError(f"{where}: 'question_id' must be a string or int, got {qid!r}")
        if not isinstance(text, str):
            raise KeyeInputError(f"{where}: 'response' must be a string")
        ids = d.get("token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids)):
            raise KeyeInputError(f"{where}: 'token_ids' must be a list of non-negative ints or null")
        reward = d.get("reward", 1.0)
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise KeyeInputError(f"{where}: 'reward' must be a number, got {reward!r}")
        meta = d.get("metadata") or {}
        if not isinstance(meta, dict):
            raise KeyeInputError(f"{where}: 'metadata' must be an object")
        return cls(str(qid), text, ids, float(reward), meta)


class ReplayPool:
    """Per-question store of verified successes.

    Args:
        max_per_question: cap on entries per question (None = unbounded).
        overflow: when a question is full, ``"drop_new"`` ignores new entries (keeps the collected pool
            intact) and ``"drop_oldest"`` evicts the oldest.
        seed: seeds the pool's own RNG used by :meth:`sample` when no ``rng`` is passed.
    """

    def __init__(self, max_per_question: int | None = None, overflow: str = "drop_new", seed: int = 0):
        if max_per_question is not None and max_per_question < 1:
            raise KeyeConfigError(f"max_per_question must be >= 1 or None, got {max_per_question}")
        if overflow not in OVERFLOW:
            raise KeyeConfigError(f"overflow must be one of {OVERFLOW}, got {overflow!r}")
        self.max_per_question = max_per_question
        self.overflow = overflow
        self.rng = random.Random(seed)
        self._entries: dict[str, list[ReplayEntry]] = {}
        self._keys: dict[str, set[tuple]] = {}

    # ------------------------------------------------------------------------------------ content
    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def __contains__(self, question_id: object) -> bool:
        return str(question_id) in self._entries

    def questions(self) -> list[str]:
        """Question ids with at least one entry, in insertion order."""
        return [q for q, v in self._entries.items() if v]

    def entries(self, question_id: str) -> list[ReplayEntry]:
        """The stored entries of a question (a copy of the list; empty if unknown)."""
        return list(self._entries.get(str(question_id), []))

    def count(self, question_id: str) -> int:
        """Number of entries stored for ``question_id``."""
        return len(self._entries.get(str(question_id), []))

    def add(self, entry: ReplayEntry) -> bool:
        """Add one entry; False if it duplicates a stored one or the question is full (``drop_new``)."""
        qid = str(entry.question_id)
        keys = self._keys.setdefault(qid, set())
        items = self._entries.setdefault(qid, [])
        k = entry.key()
        if k in keys:
            return False
        if self.max_per_question is not None and len(items) >= self.max_per_question:
            if self.overflow == "drop_new":
                return False
            keys.discard(items.pop(0).key())
        items.append(entry)
        keys.add(k)
        return True

    def add_samples(self, samples: Sequence[RolloutSample], passed: Sequence[bool], rewards: Sequence[float],
                    *, step: int | None = None) -> int:
        """Online growth: add the fresh (``source == "rollout"``), valid samples that passed; returns how many
        were new. Replayed samples are never re-added."""
        if not len(samples) == len(passed) == len(rewards):
            raise KeyeInputError(f"{len(samples)} samples, {len(passed)} pass flags, {len(rewards)} rewards")
        added = 0
        for s, ok, r in zip(samples, passed, rewards):
            if not ok or not s.valid or s.source != "rollout":
                continue
            meta = {"mode": s.prompt.mode, "source": "online"}
            if step is not None:
                meta["step"] = step
            added += self.add(ReplayEntry(s.prompt.id, s.text, [int(t) for t in s.response_ids], float(r), meta))
        return added

    def sample(self, question_id: str, m: int, rng: random.Random | None = None,
               mode: str | None = None) -> list[ReplayEntry]:
        """Up to ``m`` entries of a question, uniformly without replacement (all of them, in stored order,
        when it holds ``<= m``). ``mode`` keeps only entries recorded in that mode or with no recorded mode
        (a pool collected without mode switches serves every mode)."""
        if m < 0:
            raise KeyeInputError(f"m must be >= 0, got {m}")
        items = self._entries.get(str(question_id), [])
        if mode is not None:
            items = [e for e in items if e.metadata.get("mode") in (None, mode)]
        if len(items) <= m:
            return list(items)
        rng = rng if rng is not None else self.rng
        picks = sorted(rng.sample(range(len(items)), m))
        return [items[i] for i in picks]

    def stats(self) -> dict[str, float]:
        """``pool/questions``, ``pool/entries`` and ``pool/mean_per_question``."""
        n_q = len(self.questions())
        return {"pool/questions": float(n_q), "pool/entries": float(len(self)),
                "pool/mean_per_question": len(self) / n_q if n_q else 0.0}

    # ---------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: config, entries and the RNG state (exact resume)."""
        version, internal, gauss = self.rng.getstate()
        return {
            "max_per_question": self.max_per_question,
            "overflow": self.overflow,
            "rng": [version, list(internal), gauss],
            "entries": [asdict(e) for v in self._entries.values() for e in v],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (replaces the current content)."""
        try:
            cap, overflow = state["max_per_question"], state["overflow"]
            version, internal, gauss = state["rng"]
            rng_state = (version, tuple(internal), gauss)
            entries = state["entries"]
        except (KeyError, TypeError, ValueError) as err:
            raise KeyeInputError(f"replay pool state is malformed: {err!r}") from None
        if overflow not in OVERFLOW:
            raise KeyeInputError(f"replay pool state has unknown overflow policy {overflow!r}")
        self.max_per_question, self.overflow = cap, overflow
        self._entries, self._keys = {}, {}
        try:
            self.rng.setstate(rng_state)
        except (KeyError, TypeError, ValueError) as err:
            raise KeyeInputError(f"replay pool RNG state is malformed: {err!r}") from None
        for i, d in enumerate(entries):
            self.add(ReplayEntry.from_dict(d, f"state entry {i}"))

    def save_jsonl(self, path: str | Path) -> Path:
        """Write one JSON object per entry (``question_id``, ``response``, ``token_ids``, ``reward``,
        ``metadata``); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for items in self._entries.values():
                for e in items:
                    f.write(json.dumps(asdict(e), ensure_ascii=False) + "\n")
        return path

    @classmethod
    def load_jsonl(cls, path: str | Path, **kwargs: Any) -> ReplayPool:
        """Read a pool written by :meth:`save_jsonl` (or the phase-A output); ``kwargs`` go to the
        constructor. Raises :class:`KeyeInputError` with the path and line for bad lines."""
        path = Path(path)
        if not path.is_file():
            raise KeyeInputError("replay pool file not found", path=path)
        pool = cls(**kwargs)
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as err:
                    raise KeyeInputError(f"invalid JSON ({err.msg})", path=path, item=f"line {lineno}") from None
                try:
                    pool.add(ReplayEntry.from_dict(d, f"line {lineno}"))
                except KeyeInputError as err:
                    raise KeyeInputError(err.reason, path=path, item=f"line {lineno}") from None
        return pool


# ------------------------------------------------------------------------------------------ phase B
def replay_samples(pool: ReplayPool, prompt: RLPrompt, group: int, inputs: PromptInputs, m: int, *,
                   encode: Callable[[str], list[int]], eos_id: int, max_response_len: int,
                   rng: random.Random | None = None, match_mode: bool = True,
                   decode: Callable[[list[int]], str] | None = None) -> list[RolloutSample]:
    """Exactly ``m`` replay rows for one question's group.

    Args:
        pool: the experience pool. prompt / group / inputs: the question, its group id and its processor
            outputs (shared with the fresh rollouts of the group).
        encode: text -> token ids *without* special tokens (for text-only entries).
        eos_id: appended to re-tokenised text. max_response_len: truncation length (tokens).
        rng: RNG for the draw (default: the pool's). match_mode: draw only entries of ``prompt.mode``.
        decode: token ids -> text as the rollouts decode it (special tokens skipped); needed only when an
            entry is longer than ``max_response_len``.
        The row's ``text`` (what the reward scores) is the stored text when the entry fits, and
        ``decode(truncated ids)`` when it was truncated (``metadata["truncated"] = True``): the reward
        always judges exactly the tokens that are trained.
    Returns:
        ``m`` samples with ``source="replay"``; slots beyond the pool's supply are ``valid=False`` rows with
        no tokens (they enter no advantage statistic and no loss).
    Raises:
        KeyeConfigError: ``max_response_len < 1``, or an entry needs truncation and no ``decode`` is given.
    """
    if max_response_len < 1:
        raise KeyeConfigError(f"max_response_len must be >= 1, got {max_response_len}")
    picks = pool.sample(prompt.id, m, rng, mode=prompt.mode if match_mode else None)
    out = []
    for e in picks:
        ids = list(e.token_ids) if e.token_ids else list(encode(e.response)) + [int(eos_id)]
        text, meta = e.response, {"replay_reward": e.reward, **e.metadata}
        if len(ids) > max_response_len:
            if decode is None:
                raise KeyeConfigError(
                    f"replay entry of question {prompt.id!r} has {len(ids)} tokens, more than max_response_len "
                    f"({max_response_len}); pass decode= so the truncated response is scored on its own text")
            ids = ids[:max_response_len]
            text = decode(ids)
            meta["truncated"] = True
        out.append(RolloutSample(
            prompt=prompt, group=group, inputs=inputs, response_ids=torch.tensor(ids, dtype=torch.long),
            text=text, finished=bool(ids) and ids[-1] == int(eos_id), source="replay", metadata=meta,
        ))
    for _ in range(m - len(out)):
        out.append(RolloutSample(
            prompt=prompt, group=group, inputs=inputs, response_ids=torch.zeros(0, dtype=torch.long),
            text="", finished=False, source="replay", valid=False,
        ))
    return out


def add_replay(fresh: Sequence[RolloutSample], pool: ReplayPool, m: int, *,
               encode: Callable[[str], list[int]], eos_id: int, max_response_len: int,
               rng: random.Random | None = None, match_mode: bool = True,
               decode: Callable[[list[int]], str] | None = None) -> list[RolloutSample]:
    """RLEP phase B for a whole rollout batch: after each group's fresh samples, append its ``m`` replay rows
    (:func:`replay_samples`, sharing the group's prompt and processor outputs; ``decode`` scores truncated
    entries on their truncated ids). Group order is the order of first appearance in ``fresh``; ``m = 0``
    returns the fresh samples regrouped."""
    order: list[int] = []
    by_group: dict[int, list[RolloutSample]] = {}
    for s in fresh:
        if s.group not in by_group:
            order.append(s.group)
            by_group[s.group] = []
        by_group[s.group].append(s)
    out: list[RolloutSample] = []
    for g in order:
        members = by_group[g]
        out.extend(members)
        if m > 0:
            first = members[0]
            out.extend(replay_samples(pool, first.prompt, g, first.inputs, m, encode=encode, eos_id=eos_id,
                                      max_response_len=max_response_len, rng=rng, match_mode=match_mode,
                                      decode=decode))
    return out


