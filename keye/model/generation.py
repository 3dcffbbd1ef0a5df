"""Decoding: logits processing (repetition penalty, temperature, top-k, top-p), token selection and
incremental text streaming. The decoding loop itself is :meth:`keye.KeyeVL.generate_steps`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class GenerationConfig:
    """Decoding settings.

    ``do_sample=False`` is greedy (argmax). With sampling, logits are processed in the order
    repetition penalty -> temperature -> top-k -> top-p (as transformers does). ``eos_token_id``
    may be one id or several; a row stops at the first of them, later slots hold ``pad_token_id``.
    """

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


def apply_repetition_penalty(logits: torch.Tensor, sequences: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on every token already in the sequence: positive logits are divided by
    ``penalty``, negative ones multiplied. logits [B, V], sequences int [B, L]."""
    if penalty == 1.0:
        return logits
    scores = logits.gather(1, sequences)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(1, sequences, scores)


def top_k_top_p_filter(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and outside the smallest nucleus with mass >= top_p to -inf.
    At least one token always survives."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits


def select_next_tokens(
    logits: torch.Tensor, sequences: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Pick the next token of every row from its last-position logits [B, V]; returns int64 [B]."""
    logits = apply_repetition_penalty(logits.float(), sequences, cfg.repetition_penalty)
    if not cfg.do_sample:
        return logits.argmax(dim=-1)
    logits = top_k_top_p_filter(logits / cfg.temperature, cfg.top_k, cfg.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def iter_text(tokenizer, token_steps: Iterable[int], skip_special_tokens: bool = True) -> Iterator[str]:
    """Turn a stream of token ids into text pieces as soon as they decode to complete characters.

    The whole generated prefix is re-decoded each step and only the new suffix is yielded, so
    multi-token characters (byte-level BPE splits of UTF-8) and tokenizer clean-up rules come out
    exactly as ``tokenizer.decode`` of the full sequence would give them. A piece that ends in an
    incomplete character (U+FFFD) is held back until the next token completes it.
    """
    ids: list[int] = []
    emitted = 0
    text = ""
    for tok in token_steps:
        ids.append(int(tok))
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if text.endswith("\ufffd"):
            continue
        if len(text) > emitted:
            yield text[emitted:]
            emitted = len(text)
    if len(text) > emitted:
        yield text[emitted:]
