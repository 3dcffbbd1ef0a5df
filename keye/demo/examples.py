"""The demo's example clips: a few held-out samples of the synthetic video-QA set (keye.data.synth).

They are committed under ``demo/examples/`` in the repository (written by ``demo/make_examples.py``);
an install without that folder renders them once into ``~/.cache/keye/demo-examples``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError

# One clip per question type, from the test split (never trained on), seed 0 as the shipped set, asked the way a
# newcomer types it (keye.data.synth_forms' first free-form wording); the types in THINK_EXAMPLES end with
# /think, so the page shows keye-tiny's trace before its answer (order: its trace lists the objects with the
# second each appears, then "first the ..."; a count example with /think was tried and keye-tiny counted 3 of 4).
EXAMPLE_TYPES = ("direction", "color_change", "order")
THINK_EXAMPLES = ("order",)
# A newcomer should see the scene before and after what the question asks about: an example clip lasts at
# least MIN_SECONDS and every event in it is at least EVENT_MARGIN seconds from either end. The rule reads only
# the scene, never a model (its history: README, keye-tiny).
MIN_SECONDS = 4.0
EVENT_MARGIN = 1.0
MANIFEST = "examples.json"
REPO_EXAMPLES = Path(__file__).resolve().parents[2] / "demo" / "examples"


def shows_its_events(meta: dict[str, Any], min_seconds: float = MIN_SECONDS,
                     margin: float = EVENT_MARGIN) -> bool:
    """Whether a synthetic sample's scene (its row's ``meta``) makes a watchable example: a video of at least
    ``min_seconds`` whose every event lies at least ``margin`` seconds from the start and from the end."""
    if meta.get("modality") != "video" or float(meta["duration"]) < min_seconds:
        return False
    end = float(meta["duration"]) - margin
    return all(margin <= float(e["t"]) <= end for e in meta.get("events", []))


def write_examples(
    out_dir: str | Path, types: tuple[str, ...] = EXAMPLE_TYPES, seed: int = 0
) -> list[dict[str, Any]]:
    """Render one test-split clip per question type into ``out_dir`` as ``<type>.mp4`` and write
    ``examples.json`` (``[{"video", "question", "answer", "answer_kind", "choices", "question_type", "id"}]``,
    video names relative): the question in its first free-form wording (:func:`keye.data.synth_forms.free_form_row`,
    ``/think`` appended for :data:`THINK_EXAMPLES`), its answer and the candidates it is scored against.

    Scans test indices in order and keeps the first video sample of each type that
    :func:`shows_its_events`, so the result is deterministic and independent of any model. Raises
    :class:`KeyeConfigError` if a type is not found in the first 400 samples.
    """
    from keye.data.synth import make_sample
    from keye.data.synth_forms import free_form_row

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="keye_examples_") as tmp:
        for index in range(400):
            if len(found) == len(types):
                break
            row = make_sample(tmp, "test", index, seed, 0.1)
            qtype = row["question_type"]
            if qtype not in types or qtype in found or not shows_its_events(row["meta"]):
                continue
            media = row["messages"][0]["content"][0]["video"]
            shutil.copyfile(Path(tmp) / media, out / f"{qtype}.mp4")
            free = free_form_row(row, wording=0)
            question = free["messages"][0]["content"][1]["text"] + (" /think" if qtype in THINK_EXAMPLES else "")
            found[qtype] = {
                "video": f"{qtype}.mp4",
                "question": question,
                "answer": free["answer"],
                "answer_kind": free["answer_kind"],
                "choices": free.get("choices"),
                "question_type": qtype,
                "id": row["id"],
            }
    missing = [t for t in types if t not in found]
    if missing:
        raise KeyeConfigError(f"no test-split video sample of type(s) {missing} in the first 400 indices")
    rows = [found[t] for t in types]
    (out / MANIFEST).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def load_examples(directory: str | Path | None = None) -> list[dict[str, Any]]:
    """The example rows with absolute ``video`` paths: from ``directory`` (default: the repository's
    ``demo/examples``), else rendered once into the user cache."""
    candidates = [Path(directory)] if directory is not None else [REPO_EXAMPLES]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "keye" / "demo-examples"
    for d in [*candidates, cache]:
        if (d / MANIFEST).is_file():
            rows = json.loads((d / MANIFEST).read_text())
            if all((d / r["video"]).is_file() for r in rows):
                return [{**r, "video": str(d / r["video"])} for r in rows]
    write_examples(cache)
    rows = json.loads((cache / MANIFEST).read_text())
    return [{**r, "video": str(cache / r["video"])} for r in rows]


def answer_examples(model_dir: str | Path, rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A checkpoint's greedy replies to the example clips (default: :func:`load_examples`), in each question's
    thinking mode (a trailing ``/think``: 96 new tokens at most, else 16), scored by the synthetic set's rule on the
    answer (the part after the trace).

    Returns one ``{"question_type", "answer", "response", "think", "correct"}`` per example, in order
    (``think``: the trace, or None).
    """
    from keye.eval.runner import KeyeEngine
    from keye.eval.synth import extract, is_correct
    from keye.model.keye_vl import KeyeVL
    from keye.processing.chat import parse_response
    from keye.processing.processor import KeyeProcessor
    from keye.rewards.format import split_mode_switch

    rows = load_examples() if rows is None else rows
    model = KeyeVL.from_pretrained(model_dir, torch_dtype="float32")
    processor = KeyeProcessor.from_pretrained(model_dir)
    out: list[dict[str, Any] | None] = [None] * len(rows)
    thinking = [split_mode_switch(r["question"])[1] == "think" for r in rows]
    for think in (False, True):
        picked = [i for i, t in enumerate(thinking) if t == think]
        if not picked:
            continue
        engine = KeyeEngine(model, processor, batch_size=len(picked), max_new_tokens=96 if think else 16)
        convs = [[{"role": "user", "content": [{"type": "video", "video": rows[i]["video"]},
                                               {"type": "text", "text": rows[i]["question"]}]}] for i in picked]
        for i, reply in zip(picked, engine.generate(convs)):
            r, parsed = rows[i], parse_response(reply)
            item = {"answer_kind": r.get("answer_kind", "mc"), "choices": r.get("choices"), "answer": r["answer"]}
            out[i] = {"question_type": r["question_type"], "answer": r["answer"], "response": parsed.answer.strip(),
                      "think": parsed.think, "correct": is_correct(extract(parsed.answer, item), item)}
    return [o for o in out if o is not None]
