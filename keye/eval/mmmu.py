"""MMMU: data loading, prompts, and the official parsing, scoring and aggregation rules.

Everything that decides a score follows the official MMMU evaluation (``MMMU-Benchmark/MMMU`` @ bb0b95a) as
described in ``docs/evaluation.md`` section 1; the golden fixtures in ``tests/fixtures/golden/eval`` are reproduced to
the last printed digit by :func:`score_eval_only`.

Main pieces:

- :func:`load_mmmu` reads the 30 subject configs of ``MMMU/MMMU`` from the hub or a local parquet copy;
  :func:`item_from_row` turns a row into a plain item dict (options parsed, letters assigned).
- :func:`build_conversation` writes the prompt (official MMMU or VLMEvalKit layout) with images interleaved at
  their ``<image k>`` placeholders.
- :func:`parse_multi_choice_response` / :func:`parse_open_response` / :func:`eval_multi_choice` /
  :func:`eval_open` are the official parsers and matchers, including the seeded random fallback.
- :func:`score_eval_only` ("evaluation only") and :func:`score_records` ("parse and evaluation") produce the
  official printable dict ``{"Overall-<Discipline>": ..., "<Subject>": ..., "Overall": ...}``.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError

HUB_ID = "MMMU/MMMU"
SEED = 42

# The official short-name map; its order is the order subjects are evaluated in, which fixes the sequence of
# seeded random draws of the multiple-choice fallback.
CAT_SHORT2LONG: dict[str, str] = {
    "acc": "Accounting",
    "agri": "Agriculture",
    "arch": "Architecture_and_Engineering",
    "art": "Art",
    "art_theory": "Art_Theory",
    "bas_med": "Basic_Medical_Science",
    "bio": "Biology",
    "chem": "Chemistry",
    "cli_med": "Clinical_Medicine",
    "cs": "Computer_Science",
    "design": "Design",
    "diag_med": "Diagnostics_and_Laboratory_Medicine",
    "econ": "Economics",
    "elec": "Electronics",
    "ep": "Energy_and_Power",
    "fin": "Finance",
    "geo": "Geography",
    "his": "History",
    "liter": "Literature",
    "manage": "Manage",
    "mark": "Marketing",
    "mate": "Materials",
    "math": "Math",
    "mech": "Mechanical_Engineering",
    "music": "Music",
    "phar": "Pharmacy",
    "phys": "Physics",
    "psy": "Psychology",
    "pub_health": "Public_Health",
    "socio": "Sociology",
}
SUBJECTS: tuple[str, ...] = tuple(CAT_SHORT2LONG.values())

# Discipline -> subjects, in the official printing order.
DOMAIN_CAT2SUB_CAT: dict[str, tuple[str, ...]] = {
    "Art and Design": ("Art", "Art_Theory", "Design", "Music"),
    "Business": ("Accounting", "Economics", "Finance", "Manage", "Marketing"),
    "Science": ("Biology", "Chemistry", "Geography", "Math", "Physics"),
    "Health and Medicine": (
        "Basic_Medical_Science",
        "Clinical_Medicine",
        "Diagnostics_and_Laboratory_Medicine",
        "Pharmacy",
        "Public_Health",
    ),
    "Humanities and Social Science": ("History", "Literature", "Sociology", "Psychology"),
    "Tech and Engineering": (
        "Agriculture",
        "Architecture_and_Engineering",
        "Computer_Science",
        "Electronics",
        "Energy_and_Power",
        "Materials",
        "Mechanical_Engineering",
    ),
}

MC_INSTRUCTION = "Answer with the option's letter from the given choices directly."
OPEN_INSTRUCTION = "Answer the question using a single word or phrase."
VLMEVAL_MC_INSTRUCTION = "Please select the correct answer from the options above. \n"
PROMPT_STYLES = ("mmmu", "vlmevalkit")
IMAGE_MODES = ("interleave", "first")

_PUNCT_TRIM = (",", ".", "!", "?", ";", ":", "'")
_OPEN_INDICATORS = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")
_TRIVIAL_TAILS = (":", ",", ".", "!", "?", ";", "'")
_NUM_COMMAS = re.compile(r"-?\b\d{1,3}(?:,\d{3})+\b")
_NUM_SCIENTIFIC = re.compile(r"-?\d+(?:\.\d+)?[eE][+-]?\d+")
_NUM_SIMPLE = re.compile(r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])")
_SUBRESPONSE_SPLIT = re.compile(r"\.\s(?=[A-Z])|\n")
_IMAGE_TAG = re.compile(r"<image (\d)>")

# The official module seeds the global ``random`` at import; this private generator plays that role for
# callers that do not pass their own, so a fresh process draws the same sequence as the official scripts.
_MODULE_RNG = random.Random(SEED)


# ----------------------------------------------------------------------------------------------- data


def subject_of(item_id: str) -> str:
    """Return the subject of an MMMU id: ``"validation_Art_Theory_3"`` -> ``"Art_Theory"``.

    Raises ``KeyeInputError`` when the id does not have the ``<split>_<Subject>_<n>`` form.
    """
    parts = str(item_id).split("_")
    if len(parts) < 3:
        raise KeyeInputError(f"MMMU id {item_id!r} is not of the form <split>_<Subject>_<n>")
    return "_".join(parts[1:-1])


def _id_number(item_id: str) -> int:
    tail = str(item_id).rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def parse_options(options: Any, *, item: Any = None) -> list[str]:
    """Return the option texts of an MMMU row.

    HF stores ``options`` as the *string repr* of a Python list (``"['a', 'b']"``; ``"[]"`` for open
    questions), which is parsed with ``ast.literal_eval``; an actual list is returned as strings.
    Raises ``KeyeInputError`` when the value is not a list.
    """
    if isinstance(options, (list, tuple)):
        return [str(o) for o in options]
    if options is None or options == "":
        return []
    try:
        value = ast.literal_eval(str(options))
    except (ValueError, SyntaxError) as err:
        raise KeyeInputError(f"options {options!r} is not a Python list literal ({err})", item=item) from err
    if not isinstance(value, (list, tuple)):
        raise KeyeInputError(f"options {options!r} is not a list", item=item)
    return [str(o) for o in value]


def parse_gold(answer: Any) -> str | list[str]:
    """Return the gold answer: a string, or a list of acceptable strings for list-looking answers.

    The official answer key stores three open golds as lists (e.g. ``['24/7', '3.429']``); HF stores every
    answer as a string, so a string that is a Python list literal is turned into that list.
    """
    if isinstance(answer, (list, tuple)):
        return [str(a) for a in answer]
    text = "" if answer is None else str(answer)
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        try:
            value = ast.literal_eval(stripped)
        except (ValueError, SyntaxError):
            return text
        if isinstance(value, (list, tuple)) and value:
            return [str(a) for a in value]
    return text


def item_from_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Turn one MMMU dataset row (official columns) into an evaluation item.

    Returns a dict with ``id``, ``subject``, ``question``, ``options`` (list), ``question_type``
    (``"multiple-choice"`` or ``"open"``), ``answer`` (str or list), ``all_choices`` (letters ``A``...),
    ``index2ans`` (letter -> option text) and ``images`` (``{k: image}`` for the non-null ``image_k``).
    Raises ``KeyeInputError`` naming the id when a required column is missing.
    """
    item_id = row.get("id")
    if item_id is None:
        raise KeyeInputError("MMMU row has no 'id' column")
    for col in ("question", "options", "answer", "question_type"):
        if col not in row:
            raise KeyeInputError(f"MMMU row has no {col!r} column", item=item_id)
    options = parse_options(row["options"], item=item_id)
    qtype = "multiple-choice" if row["question_type"] == "multiple-choice" else "open"
    letters = [chr(ord("A") + i) for i in range(len(options))] if qtype == "multiple-choice" else []
    images = {k: row[f"image_{k}"] for k in range(1, 8) if row.get(f"image_{k}") is not None}
    return {
        "id": str(item_id),
        "subject": subject_of(str(item_id)),
        "question": str(row["question"]),
        "options": options,
        "question_type": qtype,
        "answer": parse_gold(row["answer"]),
        "all_choices": letters,
        "index2ans": dict(zip(letters, options)),
        "images": images,
        "subfield": row.get("subfield"),
        "img_type": row.get("img_type"),
        "topic_difficulty": row.get("topic_difficulty"),
    }


def _local_parquet_files(root: Path, split: str, subjects: Sequence[str]) -> list[Path]:
    files = sorted(p for p in root.rglob("*.parquet") if p.name.startswith(f"{split}-") or p.stem == split)
    if subjects and set(subjects) != set(SUBJECTS):
        wanted = set(subjects)
        # HF layout: <Subject>/<split>-00000-of-00001.parquet; flat copies hold every subject in one file.
        by_dir = [p for p in files if p.parent.name in wanted]
        if by_dir:
            files = by_dir
    return files


def load_mmmu(
    split: str = "validation",
    *,
    data_dir: str | Path | None = None,
    subjects: Sequence[str] | None = None,
    hub_id: str = HUB_ID,
) -> list[dict[str, Any]]:
    """Load MMMU items (see :func:`item_from_row`) ordered by subject (official order) then question number.

    Args:
        split: ``dev``, ``validation`` or ``test``.
        data_dir: a local copy: any directory holding ``<split>-*.parquet`` files (the HF repo layout
            ``<Subject>/<split>-00000-of-00001.parquet`` or flat files). ``None`` loads ``hub_id`` with
            ``datasets`` (one config per subject).
        subjects: subset of :data:`SUBJECTS` (default: all 30).

    Raises:
        KeyeInputError: unknown subject, no parquet files for the split, or the hub is unreachable and no
            local copy was given.
    """
    subjects = list(subjects) if subjects else list(SUBJECTS)
    unknown = [s for s in subjects if s not in SUBJECTS]
    if unknown:
        raise KeyeInputError(f"unknown MMMU subject(s) {unknown}; valid: {', '.join(SUBJECTS)}")
    import datasets

    rows: list[Mapping[str, Any]] = []
    if data_dir is not None:
        root = Path(data_dir)
        if not root.is_dir():
            raise KeyeInputError("MMMU data directory does not exist", path=root)
        files = _local_parquet_files(root, split, subjects)
        if not files:
            raise KeyeInputError(f"no '{split}-*.parquet' files for MMMU split {split!r}", path=root)
        ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
        rows = list(ds)
    else:
        for subject in subjects:
            try:
                ds = datasets.load_dataset(hub_id, subject, split=split)
            except Exception as err:  # network, auth or missing config: all mean "no data"
                raise KeyeInputError(
                    f"cannot load {hub_id} config {subject!r} split {split!r} from the hub ({err}); "
                    "pass a local copy (a directory of parquet files) with --data"
                ) from err
            rows.extend(ds)
    wanted = set(subjects)
    items = [item_from_row(r) for r in rows]
    items = [it for it in items if it["subject"] in wanted]
    order = {s: i for i, s in enumerate(SUBJECTS)}
    items.sort(key=lambda it: (order[it["subject"]], _id_number(it["id"])))
    return items


# --------------------------------------------------------------------------------------------- prompts


def prompt_text(item: Mapping[str, Any], style: str = "mmmu") -> str:
    """Return the text prompt of an item, ``<image k>`` placeholders still in place.

    ``style="mmmu"``: the official runner's (``configs/llava1.5.yaml``) layout,
    ``"{question}\\n(A) opt\\n(B) opt\\n\\nAnswer with the option's letter from the given choices directly."``
    or ``"{question}\\nAnswer the question using a single word or phrase."``.
    ``style="vlmevalkit"``: the layout Keye's own evaluation used, ``"Question: {q}\\nOptions:\\nA. opt\\n...
    Please select the correct answer from the options above. \\n"`` (open questions: ``"Question: {q}\\n"``).
    """
    question = str(item["question"])
    options = list(item.get("options") or [])
    is_mc = item.get("question_type") == "multiple-choice"
    if style == "mmmu":
        if is_mc:
            listed = "".join(f"({chr(ord('A') + i)}) {opt}\n" for i, opt in enumerate(options))
            return f"{question}\n{listed}\n{MC_INSTRUCTION}"
        return f"{question}\n{OPEN_INSTRUCTION}"
    if style == "vlmevalkit":
        text = f"Question: {question}\n"
        if is_mc and options:
            text += "Options:\n"
            text += "".join(f"{chr(ord('A') + i)}. {opt}\n" for i, opt in enumerate(options) if str(opt))
            text += VLMEVAL_MC_INSTRUCTION
        return text
    raise KeyeInputError(f"unknown MMMU prompt style {style!r}; expected one of {PROMPT_STYLES}")


def interleave(text: str, images: Mapping[int, Any], *, item: Any = None) -> list[dict[str, Any]]:
    """Split ``text`` at its ``<image k>`` placeholders into qwen-vl-utils content items.

    Each placeholder is replaced by ``{"type": "image", "image": images[k]}`` in place (VLMEvalKit's rule:
    unreferenced images are dropped, an image referenced twice appears twice). With no placeholder at all,
    every image comes first, then the text. Raises ``KeyeInputError`` when a referenced image is missing.
    """
    pieces = _IMAGE_TAG.split(text)
    if len(pieces) == 1:
        content: list[dict[str, Any]] = [{"type": "image", "image": images[k]} for k in sorted(images)]
        content.append({"type": "text", "text": text})
        return content
    content = []
    for i, piece in enumerate(pieces):
        if i % 2 == 1:
            k = int(piece)
            if k not in images:
                raise KeyeInputError(f"text references <image {k}> but image_{k} is empty", item=item)
            content.append({"type": "image", "image": images[k]})
        elif piece:
            content.append({"type": "text", "text": piece})
    return content


def build_conversation(
    item: Mapping[str, Any], *, style: str = "mmmu", image_mode: str = "interleave"
) -> list[dict[str, Any]]:
    """Return the one-turn conversation (qwen-vl-utils schema) that asks the model an MMMU item.

    ``image_mode="interleave"`` puts each image where its ``<image k>`` placeholder stands (how Keye was
    evaluated); ``"first"`` leaves the placeholders in the text and sends only ``image_1`` before it (the
    official LLaVA reference runner). Thinking-mode switches are not added here (the engine applies them).
    """
    text = prompt_text(item, style)
    images = dict(item.get("images") or {})
    if image_mode == "interleave":
        content = interleave(text, images, item=item.get("id"))
    elif image_mode == "first":
        content = ([{"type": "image", "image": images[1]}] if 1 in images else []) + [
            {"type": "text", "text": text}
        ]
    else:
        raise KeyeInputError(f"unknown image mode {image_mode!r}; expected one of {IMAGE_MODES}")
    return [{"role": "user", "content": content}]


# --------------------------------------------------------------------------------------------- parsing


def parse_multi_choice_response(
    response: str,
    all_choices: Sequence[str],
    index2ans: Mapping[str, str],
    rng: random.Random | None = None,
) -> str:
    """Return the option letter the official MMMU parser reads from ``response``.

    Rules (``docs/evaluation.md`` 1.3): trim runs of ``, . ! ? ; : '`` from both ends in that order (no
    whitespace trim), pad with one space; candidates are the letters whose ``(X)`` occurs, else whose ``" X "``
    occurs, else (only when the padded response has more than 5 whitespace tokens) whose lower-cased option
    text occurs in the lower-cased response. One candidate wins; several: the one whose last occurrence is
    furthest right (ties: earliest candidate); none: ``rng.choice(all_choices)``. ``rng`` defaults to a
    module-level ``random.Random(42)``, standing in for the official module's ``random.seed(42)``, so the
    draws depend on call order exactly as in the official scripts.
    """
    for ch in _PUNCT_TRIM:
        response = response.strip(ch)
    response = " " + response + " "
    candidates: list[str] = []
    with_brackets = False
    by_letter = True
    for choice in all_choices:
        if f"({choice})" in response:
            candidates.append(choice)
            with_brackets = True
    if not candidates:
        for choice in all_choices:
            if f" {choice} " in response:
                candidates.append(choice)
    if not candidates and len(response.split()) > 5:
        lowered = response.lower()
        for letter, text in index2ans.items():
            if str(text).lower() in lowered:
                candidates.append(letter)
                by_letter = False
    if not candidates:
        return (rng or _MODULE_RNG).choice(list(all_choices))
    if len(candidates) == 1:
        return candidates[0]
    if by_letter:
        pattern = "({})" if with_brackets else " {} "
        positions = [response.rfind(pattern.format(c)) for c in candidates]
    else:
        positions = [response.lower().rfind(str(index2ans[c]).lower()) for c in candidates]
    return candidates[positions.index(max(positions))]


def check_is_number(text: str) -> bool:
    """True when ``float(text with commas removed)`` succeeds (the official number test)."""
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


def normalize_str(text: str) -> list[str | float]:
    """Return the official normalised forms of one answer string.

    Trimmed numbers (commas removed) become ``[round(float, 2)]``; other strings are lower-cased, and a
    one-character string becomes ``[" x", "x "]`` so that it cannot match inside arbitrary words.
    """
    text = text.strip()
    if check_is_number(text):
        return [round(float(text.replace(",", "")), 2)]
    text = text.lower()
    if len(text) == 1:
        return [" " + text, text + " "]
    return [text]


def extract_numbers(text: str) -> list[str]:
    """Return every number in ``text``: thousands-separated ones, then scientific, then simple (official)."""
    return _NUM_COMMAS.findall(text) + _NUM_SCIENTIFIC.findall(text) + _NUM_SIMPLE.findall(text)


def _key_subresponses(response: str) -> list[str]:
    response = response.strip().strip(".").lower()
    subs = _SUBRESPONSE_SPLIT.split(response)
    keys: list[str] = []
    for index, sub in enumerate(subs):
        indicators = list(_OPEN_INDICATORS) + (["="] if index == len(subs) - 1 else [])
        shortest: str | None = None
        for indicator in indicators:
            if indicator in sub:
                tail = sub.split(indicator)[-1].strip()
                # An empty tail is falsy in the original, so the next indicator's tail replaces it whatever
                # its length.
                if not shortest or len(tail) < len(shortest):
                    shortest = tail
        if shortest and shortest.strip() not in _TRIVIAL_TAILS:
            keys.append(shortest)
    return keys or [response]


def parse_open_response(response: str) -> list[str | float]:
    """Return the official prediction list of a short-answer response (order irrelevant, duplicates removed).

    The normalised response (trimmed, ``.``-stripped, lower-cased) is split on newlines; in each line the
    shortest tail after the last occurrence of an indicator (``could be``, ``so``, ``is``, ``thus``,
    ``therefore``, ``final``, ``answer``, ``result``, and ``=`` on the last line) is a key response; with none,
    the whole response is. Key responses plus the numbers they contain go through :func:`normalize_str`.
    """
    keys = _key_subresponses(response)
    preds: list[str] = list(keys)
    for key in keys:
        preds.extend(extract_numbers(key))
    normalised: list[str | float] = []
    for pred in preds:
        normalised.extend(normalize_str(pred))
    return list(set(normalised))


def eval_multi_choice(gold: str | Sequence[str], pred: Any) -> bool:
    """Official multiple-choice match: ``pred`` equals the gold letter (or any element of a list gold)."""
    if isinstance(gold, (list, tuple)):
        return any(g == pred for g in gold)
    return gold == pred


def eval_open(gold: str | Sequence[str], preds: Iterable[str | float]) -> bool:
    """Official short-answer match of a parsed prediction list against the gold.

    A string prediction is correct when any normalised *string* gold is a substring of it; a float
    prediction when it equals any normalised float gold (both rounded to 2 decimals).
    """
    golds: list[str | float] = []
    for g in gold if isinstance(gold, (list, tuple)) else [gold]:
        golds.extend(normalize_str(str(g)))
    for pred in preds:
        if isinstance(pred, str):
            if any(isinstance(g, str) and g in pred for g in golds):
                return True
        elif pred in golds:
            return True
    return False


# --------------------------------------------------------------------------------------------- scoring


def calculate_ins_level_acc(results: Mapping[str, Mapping[str, Any]]) -> float:
    """Instance-weighted accuracy ``sum(acc_i * n_i) / sum(n_i)`` over subject results (0 when empty)."""
    acc = 0.0
    total = 0
    for res in results.values():
        acc += res["acc"] * res["num_example"]
        total += res["num_example"]
    return acc / total if total else 0


def aggregate(evaluation_result: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Return the official printable results from per-subject ``{"acc", "num_example"}`` results.

    Keys, in order: for each discipline ``Overall-<Discipline>`` and then its evaluated subjects, finally
    ``Overall``. Values are ``{"num": n, "acc": round(acc, 3)}``; discipline and overall accuracies are
    instance-weighted. A discipline with no evaluated subject is still listed, with ``num`` 0 and ``acc`` 0,
    as the official printer does.
    """
    printable: dict[str, dict[str, Any]] = {}
    for domain, subjects in DOMAIN_CAT2SUB_CAT.items():
        in_domain = {s: evaluation_result[s] for s in subjects if s in evaluation_result}
        num = sum(r["num_example"] for r in in_domain.values())
        printable[f"Overall-{domain}"] = {
            "num": int(num),
            "acc": round(calculate_ins_level_acc(in_domain), 3),
        }
        for subject, res in in_domain.items():
            printable[subject] = {"num": int(res["num_example"]), "acc": round(res["acc"], 3)}
    printable["Overall"] = {
        "num": sum(r["num_example"] for r in evaluation_result.values()),
        "acc": round(calculate_ins_level_acc(evaluation_result), 3),
    }
    return printable


def _evaluate_subject(samples: Sequence[Mapping[str, Any]]) -> tuple[dict[str, bool], dict[str, Any]]:
    judged: dict[str, bool] = {}
    for s in samples:
        if s["question_type"] == "multiple-choice":
            ok = eval_multi_choice(s["answer"], s["parsed_pred"])
        else:
            ok = eval_open(s["answer"], s["parsed_pred"])
        judged[s["id"]] = bool(ok)
    correct = sum(judged.values())
    acc = correct / len(samples) if samples else 0
    return judged, {"acc": acc, "correct": correct, "num_example": len(samples)}


def score_eval_only(
    predictions: Mapping[str, str], answers: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, bool]]:
    """Official "evaluation only" scoring (``main_eval_only``).

    Args:
        predictions: ``{id: prediction}``; multiple-choice predictions must already be letters (compared as
            given), short-answer ones are raw strings passed through :func:`parse_open_response`.
        answers: the answer key ``{id: {"question_type", "ground_truth"}}`` (``answer_dict_val.json``).

    Returns:
        ``(printable, judged)``: the official printable dict (see :func:`aggregate`) and ``{id: correct}``.

    Raises:
        KeyeInputError: a prediction id missing from the answer key.
    """
    by_subject: dict[str, list[tuple[str, Any]]] = {}
    for item_id, pred in predictions.items():
        by_subject.setdefault(subject_of(item_id), []).append((item_id, pred))
    results: dict[str, dict[str, Any]] = {}
    judged: dict[str, bool] = {}
    for subject in SUBJECTS:
        if subject not in by_subject:
            continue
        samples = []
        for item_id, pred in by_subject[subject]:
            if item_id not in answers:
                raise KeyeInputError("prediction id is not in the answer key", item=item_id)
            entry = answers[item_id]
            qtype = entry["question_type"]
            parsed = pred if qtype == "multiple-choice" else parse_open_response(str(pred))
            samples.append(
                {
                    "id": item_id,
                    "question_type": qtype,
                    "answer": entry["ground_truth"],
                    "parsed_pred": parsed,
                }
            )
        subject_judged, metrics = _evaluate_subject(samples)
        judged.update(subject_judged)
        results[subject] = metrics
    return aggregate(results), judged


def score_records(
    records: Iterable[Mapping[str, Any]], *, seed: int = SEED
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Official "parse and evaluation" scoring of stored responses (``main_parse_and_eval``).

    Each record needs ``id``, ``question_type``, ``answer`` and ``response`` (the text the parsers see, i.e.
    after Keye's post-processing), plus ``all_choices`` and ``index2ans`` for multiple choice. Records are
    parsed subject by subject in the official order and by question number within a subject, with one
    ``random.Random(seed)`` for all fallback draws, as a fresh official process would.

    Returns:
        ``(printable, per_item)`` where ``per_item[id] = {"parsed_pred", "correct"}``.

    Raises:
        KeyeInputError: a record without the fields above, or an id seen twice.
    """
    rng = random.Random(seed)
    by_subject: dict[str, list[Mapping[str, Any]]] = {}
    seen: set[str] = set()
    for rec in records:
        for key in ("id", "question_type", "answer", "response"):
            if key not in rec:
                raise KeyeInputError(f"MMMU record has no {key!r} field", item=rec.get("id"))
        if rec["id"] in seen:
            raise KeyeInputError("duplicate MMMU record id", item=rec["id"])
        seen.add(rec["id"])
        by_subject.setdefault(subject_of(rec["id"]), []).append(rec)
    results: dict[str, dict[str, Any]] = {}
    per_item: dict[str, dict[str, Any]] = {}
    for subject in SUBJECTS:
        recs = sorted(by_subject.get(subject, []), key=lambda r: _id_number(r["id"]))
        if not recs:
            continue
        samples = []
        for rec in recs:
            response = "" if rec["response"] is None else str(rec["response"])
            if rec["question_type"] == "multiple-choice":
                if "all_choices" not in rec or "index2ans" not in rec:
                    raise KeyeInputError("multiple-choice record lacks all_choices/index2ans", item=rec["id"])
                parsed: Any = parse_multi_choice_response(response, rec["all_choices"], rec["index2ans"], rng)
            else:
                parsed = parse_open_response(response)
            samples.append(
                {
                    "id": rec["id"],
                    "question_type": rec["question_type"],
                    "answer": rec["answer"],
                    "parsed_pred": parsed,
                }
            )
        judged, metrics = _evaluate_subject(samples)
        results[subject] = metrics
        for s in samples:
            per_item[s["id"]] = {"parsed_pred": s["parsed_pred"], "correct": judged[s["id"]]}
    return aggregate(results), per_item


def record_for(item: Mapping[str, Any], raw_output: str, response: str) -> dict[str, Any]:
    """Return the predictions-file record of one answered item (JSON-serialisable, no images).

    ``raw_output`` is the decoded generation, ``response`` its post-processed form (what the parsers see).
    """
    return {
        "id": item["id"],
        "subject": item["subject"],
        "question_type": item["question_type"],
        "answer": item["answer"],
        "all_choices": list(item.get("all_choices") or []),
        "index2ans": dict(item.get("index2ans") or {}),
        "raw_output": raw_output,
        "response": response,
    }
