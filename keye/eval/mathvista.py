"""MathVista: data loading, the query, answer extraction and the official normalisation and scoring.

Scoring follows the official ``lupantech/MathVista`` evaluation (@ 53d5258) as described in
``docs/evaluation.md`` section 2; :func:`calculate_score` reproduces the stored ``output_bard.json`` run
(348/1000) and every breakdown of its ``scores_bard.json``.

Extraction (:func:`extract_answer`) applies the official fast paths (empty response, exact choice text,
``int()`` / ``float()`` parseable responses), then either

- the official LLM-judge path: the official five-example demo prompt sent to an OpenAI-compatible chat
  endpoint (:class:`OpenAIJudge`, plain HTTP, optional), or
- when no judge is given, the rule-based extractor :func:`rule_extract` documented below. It is ours, not
  official; it approximates what the judge returns for well-formed answers.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError
from keye.rewards.answers import NUMBER_RE, answer_tail, final_number, leading_letter

logger = logging.getLogger(__name__)

HUB_ID = "AI4Math/MathVista"
BREAKDOWN_KEYS = (
    "question_type",
    "answer_type",
    "language",
    "source",
    "category",
    "task",
    "context",
    "grade",
    "skills",
)

HINT_MULTI_CHOICE = (
    "Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end."
)
HINT_INTEGER = (
    "Hint: Please answer the question requiring an integer answer and provide the final value, "
    "e.g., 1, 2, 3, at the end."
)
HINT_FLOAT_1 = (
    "Hint: Please answer the question requiring a floating-point number with one decimal place and provide "
    "the final value, e.g., 1.2, 1.3, 1.4, at the end."
)
HINT_FLOAT_2 = (
    "Hint: Please answer the question requiring a floating-point number with two decimal places and provide "
    "the final value, e.g., 1.23, 1.34, 1.45, at the end."
)
HINT_LIST = (
    "Hint: Please answer the question requiring a Python list as an answer and provide the final list, "
    "e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end."
)

# The in-context examples of the official extraction prompt (``evaluation/prompts/ext_ans.py``), as text.
DEMO_PROMPT = """
Please read the following example. Then extract the answer from the model response and type it at the end of the prompt.

Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.
Question: Which number is missing?

Model response: The number missing in the sequence is 14.

Extracted answer: 14

Hint: Please answer the question requiring a floating-point number with one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.
Question: What is the fraction of females facing the camera?

Model response: The fraction of females facing the camera is 0.6, which means that six out of ten females in the group are facing the camera.

Extracted answer: 0.6

Hint: Please answer the question requiring a floating-point number with two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45, at the end.
Question: How much money does Luca need to buy a sour apple candy and a butterscotch candy? (Unit: $)

Model response: Luca needs $1.45 to buy a sour apple candy and a butterscotch candy.

Extracted answer: 1.45

Hint: Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.
Question: Between which two years does the line  graph saw its maximum peak?

Model response: The line graph saw its maximum peak between 2007 and 2008.

Extracted answer: [2007, 2008]

Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.
Question: What fraction of the shape is blue?
Choices:
(A) 3/11
(B) 8/11
(C) 6/11
(D) 3/5

Model response: The correct answer is (B) 8/11.

Extracted answer: B
"""

_QUICK_RE = re.compile(r'The answer is "(.*)"\.')
_LETTER_IN_PARENS = re.compile(r"\(([a-zA-Z])\)")


# ----------------------------------------------------------------------------------------------- data


def build_query(problem: Mapping[str, Any]) -> str:
    """Return the official ``query`` of a problem (what HF's ``query`` column and ``data/query.json`` hold).

    Layout: the type's hint line, ``Question: {question}`` with `` (Unit: {unit})`` when there is a unit, and
    for multiple choice ``Choices:`` then one ``(A) text`` line per choice; the whole is trimmed. Raises ``KeyeInputError`` for an
    unknown question/answer type or a float problem without precision 1 or 2.
    """
    qtype = problem.get("question_type")
    atype = problem.get("answer_type")
    pid = problem.get("pid")
    if qtype == "multi_choice":
        hint = HINT_MULTI_CHOICE
    elif atype == "integer":
        hint = HINT_INTEGER
    elif atype == "float":
        precision = problem.get("precision")
        if precision is None or int(precision) not in (1, 2):
            raise KeyeInputError(f"float problem needs precision 1 or 2, got {precision!r}", item=pid)
        hint = HINT_FLOAT_1 if int(precision) == 1 else HINT_FLOAT_2
    elif atype == "list":
        hint = HINT_LIST
    else:
        raise KeyeInputError(f"unknown MathVista question/answer type {qtype!r}/{atype!r}", item=pid)
    question = f"Question: {problem['question']}"
    if problem.get("unit"):
        question += f" (Unit: {problem['unit']})"
    lines = [hint, question]
    if qtype == "multi_choice":
        lines.append("Choices:")
        lines.extend(f"({chr(ord('A') + i)}) {c}" for i, c in enumerate(problem.get("choices") or []))
    # The official builder trims the finished query, which drops trailing spaces of the last choice.
    return "\n".join(lines).strip()


def _normalise_row(row: Mapping[str, Any], image_root: Path | None) -> dict[str, Any]:
    problem = dict(row)
    if "pid" not in problem:
        raise KeyeInputError("MathVista row has no 'pid' column")
    problem["pid"] = str(problem["pid"])
    for col in ("question", "answer", "question_type", "answer_type"):
        if col not in problem:
            raise KeyeInputError(f"MathVista row has no {col!r} column", item=problem["pid"])
    choices = problem.get("choices")
    problem["choices"] = None if choices is None else [str(c) for c in choices]
    problem.setdefault("unit", None)
    problem.setdefault("precision", None)
    problem["metadata"] = dict(problem.get("metadata") or {})
    if not problem.get("query"):
        problem["query"] = build_query(problem)
    if problem.get("decoded_image") is None and image_root is not None and problem.get("image"):
        problem["image_path"] = str(image_root / str(problem["image"]))
    return problem


def load_mathvista(
    split: str = "testmini", *, data_dir: str | Path | None = None, hub_id: str = HUB_ID
) -> list[dict[str, Any]]:
    """Load MathVista problems in their official columns, ordered as stored.

    Args:
        split: ``testmini`` or ``test``.
        data_dir: a local copy: a directory holding ``<split>-*.parquet`` files (HF layout ``data/...``), or
            an official-format JSON file / directory with ``<split>.json`` (``{pid: problem}``) whose ``image``
            paths are relative to the JSON file. ``None`` loads ``hub_id`` with ``datasets``.

    Returns:
        Problem dicts with ``pid``, ``question``, ``choices``, ``unit``, ``precision``, ``answer``,
        ``question_type``, ``answer_type``, ``metadata``, ``query`` and the image as ``decoded_image`` (PIL)
        or ``image_path``.

    Raises:
        KeyeInputError: no data for the split, unreadable JSON, or the hub unreachable without a local copy.
    """
    import datasets

    if data_dir is None:
        try:
            ds = datasets.load_dataset(hub_id, split=split)
        except Exception as err:  # network, auth or missing split: all mean "no data"
            raise KeyeInputError(
                f"cannot load {hub_id} split {split!r} from the hub ({err}); "
                "pass a local copy (parquet directory or official JSON) with --data"
            ) from err
        return [_normalise_row(r, None) for r in ds]
    root = Path(data_dir)
    json_file = root if root.is_file() else root / f"{split}.json"
    if json_file.is_file() and json_file.suffix == ".json":
        try:
            raw = json.loads(json_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise KeyeInputError(f"cannot read MathVista JSON ({err})", path=json_file) from err
        rows = raw.values() if isinstance(raw, dict) else raw
        return [_normalise_row(r, json_file.parent) for r in rows]
    if not root.is_dir():
        raise KeyeInputError("MathVista data path does not exist", path=root)
    files = sorted(p for p in root.rglob("*.parquet") if p.name.startswith(f"{split}-") or p.stem == split)
    if not files:
        raise KeyeInputError(f"no '{split}-*.parquet' or '{split}.json' for MathVista", path=root)
    ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    return [_normalise_row(r, root) for r in ds]


def problem_image(problem: Mapping[str, Any]) -> Any:
    """Return the problem's image (PIL from ``decoded_image``, or loaded from ``image_path``).

    Raises ``KeyeInputError`` naming the pid when there is no image or the file cannot be read.
    """
    image = problem.get("decoded_image")
    if image is not None:
        return image
    path = problem.get("image_path")
    if not path:
        raise KeyeInputError("MathVista problem has no image", item=problem.get("pid"))
    from PIL import Image

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except OSError as err:
        raise KeyeInputError(f"cannot read image ({err})", path=path, item=problem.get("pid")) from err


def build_conversation(problem: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Return the one-turn conversation (qwen-vl-utils schema): the image, then the official ``query``."""
    query = problem.get("query") or build_query(problem)
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": problem_image(problem)}, {"type": "text", "text": query}],
        }
    ]


def record_for(problem: Mapping[str, Any], raw_output: str, response: str) -> dict[str, Any]:
    """Return the predictions-file record of one answered problem (JSON-serialisable, no image).

    ``raw_output`` is the decoded generation, ``response`` its post-processed form (what extraction sees).
    """
    keep = (
        "pid",
        "question",
        "choices",
        "unit",
        "precision",
        "answer",
        "question_type",
        "answer_type",
        "metadata",
        "query",
    )
    rec = {k: problem.get(k) for k in keep}
    rec["id"] = str(problem["pid"])
    rec["raw_output"] = raw_output
    rec["response"] = response
    return rec


# ------------------------------------------------------------------------------------------ extraction


def create_test_prompt(query: str, response: str, demo_prompt: str = DEMO_PROMPT) -> str:
    """Return the official judge prompt: demo examples, the query and the response, then ``Extracted answer: ``."""
    return f"{demo_prompt.strip()}\n\n{query}\n\n{response}\n\nExtracted answer: "


class OpenAIJudge:
    """Answer extractor backed by an OpenAI-compatible chat-completions endpoint, over plain HTTP.

    Args:
        url: the endpoint: either the full ``.../chat/completions`` URL or a base URL such as
            ``http://host:8000/v1`` (``/chat/completions`` is appended).
        model: model name sent in the request (the official runs used GPT-4 class models).
        api_key: sent as ``Authorization: Bearer`` when given.
        timeout: seconds per request.

    Calling the judge with a prompt returns the first choice's message content, trimmed. HTTP or format
    errors raise ``KeyeInputError`` (the official extractor turns any judge failure into ``""``, which
    :func:`extract_answer` does too).
    """

    def __init__(
        self, url: str, model: str = "gpt-4o-mini", api_key: str | None = None, timeout: float = 60.0
    ):
        self.url = (
            url if url.rstrip("/").endswith("/chat/completions") else url.rstrip("/") + "/chat/completions"
        )
        self.model = model
        self.api_key = api_key
        self.timeout = timeout

    def __call__(self, prompt: str) -> str:
        body = json.dumps(
            {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
        ).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                payload = json.loads(resp.read().decode("utf-8"))
            return str(payload["choices"][0]["message"]["content"]).strip()
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as err:
            raise KeyeInputError(f"judge request failed ({err})", path=self.url) from err


_LIST = re.compile(r"\[[^\[\]]*\]")


def rule_extract(response: str, problem: Mapping[str, Any]) -> str:
    """Rule-based answer extraction used when no LLM judge is configured (ours, not official).

    The *tail* is :func:`keye.rewards.answers.answer_tail`: the text after the last answer cue (``answer is``,
    ``answer:``, ``final answer is``, ``correct option is``, ...; case-insensitive), or the whole response.

    - multiple choice: a standalone uppercase letter opening the tail (``B``, ``(B) text``, ``**B**``,
      ``B. text``; see :func:`keye.rewards.answers.leading_letter`) that names a choice; else the last
      ``(x)`` in the response, returned as ``"(x)"`` for the official normaliser; else the choice text that
      occurs last in the tail, then in the response (longest on ties); else the tail, left to the official
      Levenshtein matching.
    - integer / float: :func:`keye.rewards.answers.final_number`: the first number of the tail after an
      answer cue, else the last number of the response (thousands commas removed, ``a/b`` divided out).
    - list: the last ``[...]`` in the response, re-joined with ``", "`` (``[1,2]`` -> ``[1, 2]``); else the
      numbers of the tail as such a list.
    - anything else: the tail without a final period.

    Returns ``""`` for an empty response.
    """
    text = response.strip()
    if not text:
        return ""
    tail = answer_tail(text)
    qtype, atype = problem.get("question_type"), problem.get("answer_type")
    if qtype == "multi_choice":
        choices = [str(c) for c in problem.get("choices") or []]
        letters = [chr(ord("A") + i) for i in range(len(choices))]
        lead = leading_letter(tail, letters)
        if lead:
            return lead
        in_parens = _LETTER_IN_PARENS.findall(text)
        if in_parens:
            return f"({in_parens[-1]})"
        for scope in (tail, text):
            lowered = scope.lower()
            hits = [(lowered.rfind(c.lower()), len(c), c) for c in choices if c and c.lower() in lowered]
            if hits:
                return max(hits)[2]
        return tail
    if atype in ("integer", "float"):
        number = final_number(text)
        return number if number is not None else tail
    if atype == "list":
        lists = _LIST.findall(text)
        if lists:
            inner = [p.strip() for p in lists[-1][1:-1].split(",") if p.strip()]
            return "[" + ", ".join(inner) + "]"
        numbers = [n.replace(",", "") for n in NUMBER_RE.findall(tail)]
        return "[" + ", ".join(numbers) + "]" if numbers else tail
    return tail.rstrip(".").strip()


def extract_answer(
    response: str,
    problem: Mapping[str, Any],
    *,
    judge: Callable[[str], str] | None = None,
    quick_extract: bool = False,
) -> str:
    """Return the extraction of ``response`` for ``problem`` by the official order of rules.

    1. empty response -> ``""``; 2. multiple choice and the response is exactly a choice -> it;
    3. integer and ``int(response)`` works -> ``str(int)``; 4. float and ``float(response)`` works ->
    ``str(float)``; 5. with ``quick_extract``, ``The answer is "(.*)".`` -> group 1;
    6. ``judge(create_test_prompt(query, response))`` when a judge is given (any judge failure gives ``""``,
    as in the official code), otherwise :func:`rule_extract`.
    """
    if response == "":
        return ""
    choices = problem.get("choices") or []
    if problem.get("question_type") == "multi_choice" and response in choices:
        return response
    atype = problem.get("answer_type")
    if atype == "integer":
        try:
            return str(int(response))
        except ValueError:
            pass
    if atype == "float":
        try:
            return str(float(response))
        except ValueError:
            pass
    if quick_extract:
        match = _QUICK_RE.search(response)
        if match:
            return match.group(1)
    if judge is None:
        return rule_extract(response, problem)
    query = problem.get("query") or build_query(problem)
    try:
        return judge(create_test_prompt(query, response))
    except Exception as err:  # the official extractor maps every judge failure to ""
        logger.warning("judge failed for pid %s: %s", problem.get("pid"), err)
        return ""


# ------------------------------------------------------------------------------------------- scoring


def get_most_similar(prediction: str, choices: Sequence[str]) -> str:
    """Return the choice with the smallest Levenshtein distance to ``prediction`` (first wins ties)."""
    from Levenshtein import distance

    distances = [distance(prediction, c) for c in choices]
    return choices[distances.index(min(distances))]


def normalize_extracted_answer(
    extraction: Any,
    choices: Sequence[str] | None,
    question_type: str,
    answer_type: str,
    precision: Any,
    *,
    ignore_empty_extractions: bool = False,
) -> str | None:
    """Official normalisation of an extraction to the problem's answer type (``docs/evaluation.md`` 2.4).

    - multi_choice: trim (non-strings are stringified); the first ``(x)`` letter, upper-cased, replaces the
      text; a letter ``A``.. naming a choice maps to that choice; anything else maps to the nearest choice by
      Levenshtein distance. With ``ignore_empty_extractions`` an empty extraction gives None.
    - integer: ``str(int(float(x)))`` (truncates); float: ``str(round(float(x), int(precision)))``;
      list: ``str(x)``. A failed conversion gives None.
    """
    if question_type == "multi_choice":
        text = extraction.strip() if isinstance(extraction, str) else str(extraction)
        if ignore_empty_extractions and not text:
            return None
        letters = _LETTER_IN_PARENS.findall(text)
        if letters:
            text = letters[0].upper()
        options = [chr(ord("A") + i) for i in range(len(choices or []))]
        if text in options:
            return list(choices or [])[options.index(text)]
        if not choices:
            return None
        return get_most_similar(text, list(choices))
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))
        if answer_type == "float":
            return str(round(float(extraction), int(precision)))
        if answer_type == "list":
            return str(extraction)
    except (TypeError, ValueError, OverflowError):
        return None
    return None


def safe_equal(prediction: Any, answer: Any) -> bool:
    """Official correctness: plain ``==`` of the normalised prediction and the gold (no trimming)."""
    try:
        return bool(prediction == answer)
    except Exception:  # exotic types comparing badly count as wrong, as in the original
        return False


def _breakdown_values(problems: Sequence[Mapping[str, Any]], key: str) -> list[Any]:
    values: list[Any] = []
    seen: set[Any] = set()
    for p in problems:
        raw = p.get(key)
        for v in raw if key == "skills" and isinstance(raw, (list, tuple)) else [raw]:
            if v is not None and v not in seen:
                seen.add(v)
                values.append(v)
    return values


def calculate_score(
    problems: Mapping[str, Mapping[str, Any]], *, ignore_empty_extractions: bool = False
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Official ``calculate_score``: normalise each ``extraction``, compare with ``answer``, break down.

    Args:
        problems: ``{pid: problem}`` in file order; each problem needs ``extraction``, ``answer``,
            ``choices``, ``question_type``, ``answer_type``, ``precision`` and ``metadata``.

    Returns:
        ``(scores, per_item)``. ``scores["average"] = {"accuracy": fraction, "correct", "total"}``, and for
        each key of :data:`BREAKDOWN_KEYS` ``scores[key] = {value: {"accuracy", "correct", "total"}}`` with
        values sorted by accuracy, descending, ties in first-seen order (a ``skills`` list counts the problem
        once per skill; the official order of tied skills comes from a Python set and is not reproducible,
        first-seen order is used instead). ``per_item[pid] = {"prediction", "true_false"}``.

    Raises:
        KeyeInputError: a problem lacks one of the fields above.
    """
    rows: list[dict[str, Any]] = []
    per_item: dict[str, dict[str, Any]] = {}
    for pid, problem in problems.items():
        for key in ("extraction", "answer", "question_type", "answer_type"):
            if key not in problem:
                raise KeyeInputError(f"MathVista problem has no {key!r} field", item=pid)
        prediction = normalize_extracted_answer(
            problem["extraction"],
            problem.get("choices"),
            problem["question_type"],
            problem["answer_type"],
            problem.get("precision"),
            ignore_empty_extractions=ignore_empty_extractions,
        )
        true_false = safe_equal(prediction, problem["answer"])
        per_item[str(pid)] = {"prediction": prediction, "true_false": true_false}
        row = {k: v for k, v in problem.items() if k != "metadata"}
        row.update(problem.get("metadata") or {})  # metadata keys override, as the official merge does
        row["true_false"] = true_false
        rows.append(row)
    total = len(rows)
    correct = sum(r["true_false"] for r in rows)
    scores: dict[str, Any] = {
        "average": {"accuracy": correct / total if total else 0.0, "correct": correct, "total": total}
    }
    for key in BREAKDOWN_KEYS:
        table: dict[Any, dict[str, Any]] = {}
        for value in _breakdown_values(rows, key):
            if key == "skills":
                subset = [r for r in rows if isinstance(r.get(key), (list, tuple)) and value in r[key]]
            else:
                subset = [r for r in rows if r.get(key) == value]
            if subset:
                hit = sum(r["true_false"] for r in subset)
                table[value] = {"accuracy": hit / len(subset), "correct": hit, "total": len(subset)}
        scores[key] = dict(sorted(table.items(), key=lambda kv: kv[1]["accuracy"], reverse=True))
    return scores, per_item


def score_records(
    records: Iterable[Mapping[str, Any]],
    *,
    judge: Callable[[str], str] | None = None,
    quick_extract: bool = False,
    reextract: bool = False,
    ignore_empty_extractions: bool = False,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Extract (when needed) and score stored MathVista records; returns :func:`calculate_score`'s pair.

    Records are our predictions-file records (see :func:`record_for`) or official ``output_*.json``
    problems. A record's ``extraction`` is reused unless ``reextract`` is set or it is missing; then the
    ``response`` (post-processed text) is extracted with :func:`extract_answer`. The per-item dict also
    carries the ``extraction`` used. Raises ``KeyeInputError`` for a record with neither field, or a pid
    seen twice.
    """
    problems: dict[str, dict[str, Any]] = {}
    for rec in records:
        pid = str(rec.get("pid", rec.get("id")))
        if pid in problems:
            raise KeyeInputError("duplicate MathVista record pid", item=pid)
        problem = dict(rec)
        if reextract or "extraction" not in problem:
            if "response" not in problem:
                raise KeyeInputError("MathVista record has neither 'extraction' nor 'response'", item=pid)
            response = "" if problem["response"] is None else str(problem["response"])
            problem["extraction"] = extract_answer(
                response, problem, judge=judge, quick_extract=quick_extract
            )
        problems[pid] = problem
    scores, per_item = calculate_score(problems, ignore_empty_extractions=ignore_empty_extractions)
    for pid, info in per_item.items():
        info["extraction"] = problems[pid]["extraction"]
    return scores, per_item
