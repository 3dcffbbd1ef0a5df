"""More ways to ask the synthetic set's questions (:mod:`keye.data.synth`): free-form wording, thinking-mode
rows and text-only greetings, the data that lets keye-tiny answer what a newcomer types.

The set's multiple-choice rows list their options and ask for the option's text. A newcomer asks
``Which way does the red circle move?`` instead. :func:`free_form_row` rewrites a row's question in one of
a few plain wordings per type (no options, no "Answer with ..." suffix). The answer stays the same word
(``right``, ``red``, ``the blue square``, ``3``). Multiple-choice types become ``answer_kind "text"``: the
answer is that word and ``choices`` lists every answer the type can have (the seven colours, the four
shapes or directions, left / right, the clip's objects for ``order``). :mod:`keye.data.synth_answers`
scores a reply by the candidate it names last, so a reply naming a wrong colour is wrong even when that
colour was not among the hidden options. ``count`` and the ``when_*`` questions keep ``numeric``, worded
without "(in seconds)" and "Answer with a number." (``When does the red circle appear?``).

:func:`mode_row` turns a row (made with ``modes=True``, either wording) into its ``think`` / ``no_think`` SFT
row: the prompt ends with ``/think`` or ``/no_think`` and the target is ``<think>TRACE</think>ANSWER`` or the
bare answer. The trace is the one :func:`keye.data.synth.mode_targets` wrote from the scene.
:func:`greeting_rows` gives text-only rows (``Hello``, ``What can you do?``) with replies that say what the
model is and what to ask it.

Every choice is drawn from a generator seeded by the row's id, so a manifest rewritten twice is the same.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import numpy as np

from keye.data.synth import COLORS, DIRECTIONS, LETTERS, SHAPES

# Plain wordings per question type. Group names fill the templates; each pattern matches the first line of
# the set's own question text (keye.data.synth's question builders).
_PATTERNS: dict[str, re.Pattern[str]] = {
    "color": re.compile(r"What colour is the (?P<s>\w+)\?"),
    "shape": re.compile(r"What shape is the (?P<c>\w+) object\?"),
    "direction": re.compile(r"In which direction does the (?P<c>\w+) (?P<s>\w+) move\?"),
    "order": re.compile(r"Which shape appears first\?"),
    "color_change": re.compile(r"The (?P<c>\w+) (?P<s>\w+) changes colour\. What colour does it become\?"),
    "detail": re.compile(r"A tiny white shape is shown briefly\. What shape is it\?"),
    "position": re.compile(r"Is the (?P<c1>\w+) (?P<s1>\w+) to the left or to the right of the (?P<c2>\w+) (?P<s2>\w+)\?"),
    "count": re.compile(r"How many shapes (?:appear in the video in total|are in the image)\?"),
    "when_appear": re.compile(r"At what time \(in seconds\) does the (?P<o>[\w ]+?) appear\?"),
    "when_change": re.compile(r"At what time \(in seconds\) does the (?P<s>\w+) change colour\?"),
    "when_collide": re.compile(r"At what time \(in seconds\) do the (?P<a>[\w ]+?) and the (?P<b>[\w ]+?) touch\?"),
    "when_leave": re.compile(r"At what time \(in seconds\) has the (?P<o>[\w ]+?) completely left the frame\?"),
}
FREE_WORDINGS: dict[str, tuple[str, ...]] = {
    "color": ("What colour is the {s}?", "What color is the {s}?", "Which colour is the {s}?",
              "What is the colour of the {s}?"),
    "shape": ("What shape is the {c} object?", "What shape is the {c} one?", "Which shape is {c}?",
              "What is the {c} shape?"),
    "direction": ("Which way does the {c} {s} move?", "In which direction does the {c} {s} move?",
                  "Where does the {c} {s} go?", "Which direction is the {c} {s} moving?"),
    "order": ("Which shape appears first?", "What appears first?", "Which object comes first?",
              "What shows up first?"),
    "color_change": ("What colour does the {c} {s} turn into?", "What color does the {c} {s} become?",
                     "The {c} {s} changes colour. What colour does it become?", "What colour does the {c} {s} turn?"),
    "detail": ("What shape is the tiny white object?", "A tiny white shape is shown briefly. What shape is it?",
               "Which shape is the small white one?"),
    "position": ("Is the {c1} {s1} to the left or to the right of the {c2} {s2}?",
                 "Is the {c1} {s1} left or right of the {c2} {s2}?",
                 "Where is the {c1} {s1}, left or right of the {c2} {s2}?"),
    "count_video": ("How many shapes appear in the video?", "How many shapes are there?",
                    "How many objects appear in total?", "How many shapes do you see?"),
    "count_image": ("How many shapes are in the image?", "How many shapes are there?",
                    "How many objects do you see?", "How many shapes do you see?"),
    "when_appear": ("When does the {o} appear?", "At what second does the {o} appear?",
                    "When does the {o} show up?"),
    "when_change": ("When does the {s} change colour?", "When does the {s} change color?",
                    "At what second does the {s} change colour?"),
    "when_collide": ("When do the {a} and the {b} touch?", "When do the {a} and the {b} collide?",
                     "At what second do the {a} and the {b} touch?"),
    "when_leave": ("When has the {o} left the frame?", "When is the {o} gone?",
                   "At what second has the {o} completely left the frame?"),
}
# Every answer a free-form question of the type can have (order's are the clip's own objects).
_CANDIDATES: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS), "color_change": tuple(COLORS), "shape": SHAPES, "detail": SHAPES,
    "direction": tuple(DIRECTIONS), "position": ("left", "right"),
}
FREE_TYPES = frozenset(_PATTERNS)
"""The question types :func:`free_form_row` rewrites: every default type of :mod:`keye.data.synth` (the
opt-in ``when_gap`` / ``when_sum`` / ``price_sum`` keep their wording)."""

GREETING_REPLY = "Hello! I am keye-tiny. Show me a clip of shapes and ask about colour, shape, motion, order or count."
ABOUT_REPLY = "I am keye-tiny, a small Keye video model. Ask me about a clip of shapes: colour, shape, motion, order or count."
THANKS_REPLY = "You are welcome."
_GREETINGS: dict[str, tuple[str, ...]] = {
    GREETING_REPLY: ("Hello", "Hi", "Hey", "Hello there", "Good morning", "Good evening", "Hi there", "Howdy"),
    ABOUT_REPLY: ("Who are you?", "What can you do?", "What are you?", "Help", "What can I ask you?",
                  "What do you know?", "Introduce yourself"),
    THANKS_REPLY: ("Thanks", "Thank you", "Thanks a lot", "Great, thank you"),
}
GREETING_TRACE = "a greeting, no clip to look at"


_SOURCE_KEYS = ("modes", "caption", "auto_mode")  # what a row made with modes=True carries for building others


def _without(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in keys}


def _rng(row_id: str, salt: int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(row_id.encode()), salt])


def _question_part(row: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The user turn's text item and its index (the question follows the clip)."""
    content = row["messages"][0]["content"]
    for i, part in enumerate(content):
        if part.get("type") == "text":
            return part, i
    raise ValueError(f"row {row.get('id')!r}: the user turn has no text")


def free_form_row(row: dict[str, Any], wording: int | None = None) -> dict[str, Any]:
    """Return ``row`` (a :mod:`keye.data.synth` row of a type in :data:`FREE_TYPES`) asked in a free-form
    wording: wording ``wording`` of the type's :data:`FREE_WORDINGS` (default: drawn from the row's id),
    id ``<id>-free``, ``form: "free"``, the assistant turn (and any ``modes`` targets) kept. Multiple-choice
    rows become ``answer_kind "text"`` with ``answer`` the option's text and ``choices`` every candidate
    answer (the module docstring); ``count`` and the ``when_*`` types stay numeric.

    Raises:
        ValueError: a type outside :data:`FREE_TYPES`, or a question the type's pattern does not match
            (a manifest not written by :mod:`keye.data.synth`).
    """
    qtype = row.get("question_type")
    if qtype not in FREE_TYPES:
        raise ValueError(f"row {row.get('id')!r}: question type {qtype!r} has no free-form wording")
    part, index = _question_part(row)
    first = part["text"].split("\n", 1)[0]
    match = _PATTERNS[qtype].match(first)
    if match is None:
        raise ValueError(f"row {row.get('id')!r}: {first!r} is not a {qtype} question of the synthetic set")
    key = f"count_{row.get('meta', {}).get('modality', 'video')}" if qtype == "count" else qtype
    wordings = FREE_WORDINGS[key]
    pick = int(_rng(str(row["id"]), 1).integers(len(wordings))) if wording is None else wording % len(wordings)
    out = _without(row, "messages")
    user = dict(row["messages"][0])
    user["content"] = list(user["content"])
    user["content"][index] = {**part, "text": wordings[pick].format(**match.groupdict())}
    out["messages"] = [user, *row["messages"][1:]]
    out["id"] = f"{row['id']}-free"
    out["form"] = "free"
    if row["answer_kind"] == "mc":
        target = row["choices"][LETTERS.index(row["answer"])]
        out["answer_kind"] = "text"
        out["answer"] = target
        out["choices"] = list(_CANDIDATES.get(qtype, row["choices"]))
    return out


def mode_row(row: dict[str, Any], mode: str) -> dict[str, Any]:
    """Return the ``mode`` (``"think"`` or ``"no_think"``) SFT row of ``row`` (a row with ``modes``, from
    ``modes=True`` or :func:`greeting_rows`, in either wording): the prompt with the mode's switch, the
    mode's target as the assistant turn, id ``<id>-<mode>``, ``mode`` set.

    Raises:
        ValueError: another mode, or a row without ``modes``.
    """
    from keye.processing.chat import apply_mode

    if mode not in ("think", "no_think"):
        raise ValueError(f"mode must be 'think' or 'no_think', not {mode!r}")
    if "modes" not in row:
        raise ValueError(f"row {row.get('id')!r} has no 'modes' (generate the set with modes=True)")
    out = _without(row, "messages", *_SOURCE_KEYS)
    out["id"] = f"{row['id']}-{mode}"
    out["messages"] = [apply_mode([row["messages"][0]], mode)[0],
                       {"role": "assistant", "content": [{"type": "text", "text": row["modes"][mode]}]}]
    out["mode"] = mode
    return out


def greeting_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` text-only rows: a greeting, a question about the model, or thanks (in a random case and
    punctuation), with its reply as the assistant turn and ``modes`` (``think``: the reply after a one-line
    trace), ids ``greeting-<k>``. They carry no answer, so they train but never evaluate."""
    rng = np.random.default_rng([seed, 0x6E1])
    pairs = [(prompt, reply) for reply, prompts in _GREETINGS.items() for prompt in prompts]
    rows = []
    for k in range(n):
        prompt, reply = pairs[int(rng.integers(len(pairs)))]
        if rng.random() < 0.3:
            prompt = prompt.lower()
        if not prompt.endswith("?") and rng.random() < 0.5:
            prompt += str(rng.choice(["!", ".", " :)"]))
        rows.append({"id": f"greeting-{k:05d}", "question_type": "greeting",
                     "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": reply}]}],
                     "modes": {"think": f"<think>{GREETING_TRACE}</think>{reply}", "no_think": reply}})
    return rows


def forms_rows(rows: list[dict[str, Any]], greetings: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """The SFT rows of keye-tiny's forms stage from ``rows`` (made with ``modes=True``): per row its
    multiple-choice question as it is, the free-form wording (types in :data:`FREE_TYPES`) and one thinking
    mode row (``think`` two times in three, else ``no_think``) on either wording; then ``greetings``
    :func:`greeting_rows` and their mode rows. Plain rows (no switch) answer directly, as before."""
    out = []
    for row in rows:
        rng = _rng(str(row["id"]), 2)
        out.append(_without(row, *_SOURCE_KEYS))
        free = free_form_row(row) if row["question_type"] in FREE_TYPES else None
        if free is not None:
            out.append(_without(free, *_SOURCE_KEYS))
        source = free if free is not None and rng.random() < 0.5 else row
        out.append(mode_row(source, "think" if rng.random() < 2 / 3 else "no_think"))
    for g in greeting_rows(greetings, seed):
        out.append(_without(g, *_SOURCE_KEYS))
        out.append(mode_row(g, "think" if g["id"][-1] in "02468" else "no_think"))
    return out
