"""Tiny Qwen-style byte-level BPE tokenizers for offline tests, trained with the ``tokenizers`` library.

Real checkpoints ship their own tokenizer, loaded with ``transformers.AutoTokenizer``; nothing here is
used for them. The tiny tokenizer mirrors the Qwen2 layout: ordinary byte-level BPE tokens get ids
``[0, n_ordinary)`` and the Qwen added tokens follow in their official order (architecture.md §11.1), so
with ``n_ordinary=480`` the ids match the golden tiny model (``<|endoftext|>`` = 480 ...
``<|clip_time_end|>`` = 511). The 1.5 variant appends ``<|frame|>``, ``<|fast_start|>``, ``<|fast_end|>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from keye.errors import KeyeConfigError

# (token, special) in id order, starting at <|endoftext|>; §11.1.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", False),
    ("<|object_ref_end|>", False),
    ("<|box_start|>", False),
    ("<|box_end|>", False),
    ("<|quad_start|>", False),
    ("<|quad_end|>", False),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|point_start|>", False),
    ("<|point_end|>", False),
    ("<|ocr_text_start|>", False),
    ("<|ocr_text_end|>", False),
    ("<|clip_time_start|>", False),
    ("<|clip_time_end|>", False),
)
# Keye-VL-1.5 slow-fast markers (§10.6); their real ids are unverified (§13), so they are looked up by name.
KEYE15_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|frame|>", True),
    ("<|fast_start|>", True),
    ("<|fast_end|>", True),
)
ADDITIONAL_SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen2's pre-tokenizer pattern: digits are split one by one, as the real tokenizer does.
QWEN_SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_WORDS = (
    "the a an of to and in is it that for on with as at by from this be are was were or not what which who "
    "how when where why there here video image picture frame scene person man woman child dog cat car door "
    "room table chair hand red green blue yellow black white left right top bottom first second last next "
    "open close opens closes walk walks run runs sit stand hold holds look looks turn moves happen happens "
    "after before during then while answer question think analysis reasoning step final result boxed value "
    "number count how many total sum difference because therefore so since option choose correct wrong true "
    "false yes no maybe one two three four five six seven eight nine ten you are helpful assistant system "
    "user describe explain please briefly detail shows shown show see seen visible appears outside inside "
    "between behind front above below near far large small big little long short time second minute clip "
    "start end begin begins ends text title sign read reads written word words letter letters mode auto"
).split()


def default_corpus(repeats: int = 40) -> list[str]:
    """A small built-in English + digits corpus (deterministic) used to train the tiny BPE."""
    lines = []
    n = len(_WORDS)
    for r in range(repeats):
        words = [_WORDS[(i * 7 + r * 13) % n] for i in range(24)]
        lines.append(
            " ".join(words).capitalize()
            + f". {r} {r * 37 % 1000}.{r % 10} seconds, option ({'ABCD'[r % 4]})."
        )
    lines.append(" ".join(_WORDS))
    lines.append(
        "You are a helpful assistant.\n<think>\n\n</think>\n\n<answer>\\boxed{42}</answer> /think /no_think"
    )
    return lines


def train_tiny_tokenizer(
    corpus: Iterable[str] | None = None, n_ordinary: int = 480, variant: str = "preview"
) -> Tokenizer:
    """Train a Qwen2-style byte-level BPE with exactly ``n_ordinary`` ordinary tokens, then add the Qwen
    added tokens (ids ``n_ordinary ...``) and, for ``variant="1.5"``, the three slow-fast markers.

    ``n_ordinary`` must be >= 257 (the 256-byte alphabet plus at least one merge). Raises
    :class:`KeyeConfigError` if the corpus cannot produce that many tokens.
    """
    if n_ordinary < 257:
        raise KeyeConfigError(f"n_ordinary must be >= 257 (byte alphabet + merges), got {n_ordinary}")
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_ordinary,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else default_corpus(), trainer=trainer)
    if tok.get_vocab_size() != n_ordinary:
        raise KeyeConfigError(
            f"tokenizer corpus too small: got {tok.get_vocab_size()} ordinary tokens, wanted {n_ordinary}"
        )
    added = QWEN_ADDED_TOKENS + (KEYE15_ADDED_TOKENS if variant == "1.5" else ())
    for content, special in added:
        token = AddedToken(
            content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
        )
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    for i, (content, _) in enumerate(added):
        if tok.token_to_id(content) != n_ordinary + i:
            raise KeyeConfigError(
                f"added token {content} got id {tok.token_to_id(content)}, expected {n_ordinary + i}"
            )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, variant: str = "preview") -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` so ``AutoTokenizer.from_pretrained(out_dir)``
    loads it offline, with Qwen's settings (eos ``<|im_end|>``, pad ``<|endoftext|>``, no BOS)."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = ADDITIONAL_SPECIAL + ([t for t, _ in KEYE15_ADDED_TOKENS] if variant == "1.5" else [])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=extra,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = False
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return out
