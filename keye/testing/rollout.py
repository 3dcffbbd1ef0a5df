"""A model-free rollout worker for testing the asynchronous RL managers.

:class:`FakeRolloutWorker` implements :class:`keye.rl.rollout.rollout_manager.RolloutWorker`. Each answer is a fixed
function of ``(prompt_id, sample)``: its length comes from ``lengths`` and token ``p`` is
:func:`expected_token` (the last one is the EOS id), so a test can check that an answer continued across
workers, pauses and weight updates is exactly the one a single uninterrupted worker would have produced,
with no token lost or repeated. The behaviour log-prob of a token is :func:`expected_logp` of it and of the
weight version that sampled it, so a test can also check which version produced each token.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

from keye.rl.rollout.rollout_manager import Finished, TokenChunk
from keye.rl.rollout.trajectory import Request

EOS = 1


def expected_token(prompt_id: str, sample: int, position: int, length: int) -> int:
    """Token ``position`` of the answer ``(prompt_id, sample)`` of ``length`` tokens: EOS last, otherwise a
    hash in ``2..65537``."""
    if position == length - 1:
        return EOS
    return 2 + zlib.crc32(f"{prompt_id}/{sample}/{position}".encode()) % 65536


def expected_logp(token: int, version: int) -> float:
    """The behaviour log-prob the fake reports for ``token`` sampled by weights ``version``."""
    return -((token % 97) + 1) / 100.0 - version


class WorkerDied(RuntimeError):
    """Raised by a :class:`FakeRolloutWorker` call once it has died."""


class FakeRolloutWorker:
    """Emits ``tokens_per_poll`` tokens per held request on every :meth:`poll` (unless paused).

    Args:
        lengths: ``lengths(prompt_id, sample) -> int`` (>= 1) answer length including the EOS.
        version: the weight version it serves at first.
        tokens_per_poll: chunk size.
        die_at_poll: the poll (1-based) during which the worker dies; it first samples that step's tokens,
            then loses them and raises :class:`WorkerDied` (a death in the middle of a step). After that
            every call raises and :meth:`alive` is False.
        dead_at_poll: from that poll on :meth:`alive` is False and polls return nothing (a silent death).
    """

    def __init__(self, lengths: Callable[[str, int], int], *, version: int = 0, tokens_per_poll: int = 1,
                 die_at_poll: int | None = None, dead_at_poll: int | None = None):
        self.lengths = lengths
        self.version = version
        self.tokens_per_poll = tokens_per_poll
        self.die_at_poll = die_at_poll
        self.dead_at_poll = dead_at_poll
        self.polls = 0
        self.paused = False
        self.dead = False
        self.held: dict[int, dict[str, Any]] = {}
        self.loaded: list[int] = []  # versions passed to load_weights, in order

    def _check(self) -> None:
        if self.dead:
            raise WorkerDied("the fake rollout worker is dead")

    def alive(self) -> bool:
        """False after the worker died."""
        return not self.dead

    def submit(self, requests: Sequence[Request]) -> None:
        """Hold the requests; checks that a continuation's tokens are the expected prefix."""
        self._check()
        for r in requests:
            length = self.lengths(r.prompt_id, r.sample)
            want = [expected_token(r.prompt_id, r.sample, p, length) for p in range(len(r.tokens))]
            if list(r.tokens) != want:
                raise AssertionError(f"trajectory {r.traj_id}: continuation tokens {list(r.tokens)[:8]} are not "
                                     f"the answer's prefix {want[:8]}")
            budget = r.max_new_tokens if r.max_new_tokens is not None else length
            self.held[r.traj_id] = {"req": r, "pos": len(r.tokens), "length": length, "left": budget}

    def pause(self) -> None:
        """Stop sampling (events are produced inside :meth:`poll`, so nothing is pending)."""
        self._check()
        self.paused = True

    def resume(self) -> None:
        """Sample again on the next polls."""
        self._check()
        self.paused = False

    def load_weights(self, shards: Any, version: int) -> None:
        """Serve ``version`` from now on (``shards`` is ignored)."""
        self._check()
        self.version = version
        self.loaded.append(version)

    def poll(self) -> list[TokenChunk | Finished]:
        """Advance every held request by up to ``tokens_per_poll`` tokens and report the events."""
        self._check()
        self.polls += 1
        if self.dead_at_poll is not None and self.polls >= self.dead_at_poll:
            self.dead = True
            return []
        if self.paused:
            return []
        events: list[TokenChunk | Finished] = []
        for tid in list(self.held):
            h = self.held[tid]
            r: Request = h["req"]
            if h["pos"] > 0 and expected_token(r.prompt_id, r.sample, h["pos"] - 1, h["length"]) == EOS:
                events.append(Finished(tid, r.attempt, "stop"))  # its EOS arrived before a worker death
                del self.held[tid]
                continue
            n = min(self.tokens_per_poll, h["length"] - h["pos"], h["left"])
            toks = tuple(expected_token(r.prompt_id, r.sample, h["pos"] + j, h["length"]) for j in range(n))
            if toks:
                events.append(TokenChunk(tid, r.attempt, toks, tuple(expected_logp(t, self.version) for t in toks),
                                         self.version))
            h["pos"] += n
            h["left"] -= n
            if h["pos"] == h["length"]:
                events.append(Finished(tid, r.attempt, "stop"))
                del self.held[tid]
            elif h["left"] == 0:
                events.append(Finished(tid, r.attempt, "length"))
                del self.held[tid]
        if self.die_at_poll is not None and self.polls >= self.die_at_poll:
            self.dead = True
            raise WorkerDied(f"the fake rollout worker died during poll {self.polls} ({len(events)} events lost)")
        return events
