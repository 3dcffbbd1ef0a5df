"""Fixtures of the evaluation tests: golden file paths, tiny benchmark sets in the official schemas, fakes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.paths import GOLDEN_EVAL


@pytest.fixture(scope="session")
def golden_eval() -> Path:
    assert GOLDEN_EVAL.is_dir(), f"golden eval fixtures not found at {GOLDEN_EVAL}"
    return GOLDEN_EVAL


class CannedEngine:
    """Fake engine: answers each conversation from a function of its text (records every call)."""

    def __init__(self, answer_fn):
        self.answer_fn = answer_fn
        self.calls: list[int] = []
        self.kwargs: list[dict[str, Any]] = []

    def generate(self, conversations, **gen_kwargs):
        self.calls.append(len(conversations))
        self.kwargs.append(gen_kwargs)
        return [self.answer_fn(conversation_text(c)) for c in conversations]


def conversation_text(conversation) -> str:
    """All text of a conversation, items joined (images shown as ``<img>``)."""
    parts = []
    for message in conversation:
        content = message["content"]
        if isinstance(content, str):
            parts.append(content)
            continue
        for item in content:
            parts.append(item["text"] if item["type"] == "text" else f"<{item['type']}>")
    return "".join(parts)


def _image(color: tuple[int, int, int], size: int = 56):
    from PIL import Image

    return Image.new("RGB", (size, size), color)


MMMU_ROWS = [
    # (subject, n, question, options, answer, question_type, images referenced)
    ("Art", 1, "Which colour is <image 1>?", ["red", "blue", "green", "white"], "A", "multiple-choice", 1),
    (
        "Art",
        2,
        "Compare <image 1> and <image 2>. Which is darker?",
        ["first", "second"],
        "B",
        "multiple-choice",
        2,
    ),
    ("Art", 3, "How many squares are in <image 1>?", [], "1", "open", 1),
    ("Math", 1, "What is 2+2?", ["3", "4", "5"], "B", "multiple-choice", 0),
    ("Math", 2, "Area of the square <image 1> with side 3?", [], "9", "open", 1),
    ("Math", 3, "Pick the prime.", ["4", "6", "7", "9"], "C", "multiple-choice", 0),
]


def write_mmmu_dir(root: Path, split: str = "validation") -> Path:
    """Write a tiny MMMU copy in the HF layout ``<Subject>/<split>-00000-of-00001.parquet``."""
    import datasets

    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "question": datasets.Value("string"),
            "options": datasets.Value("string"),
            "explanation": datasets.Value("string"),
            **{f"image_{k}": datasets.Image() for k in range(1, 8)},
            "img_type": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "topic_difficulty": datasets.Value("string"),
            "question_type": datasets.Value("string"),
            "subfield": datasets.Value("string"),
        }
    )
    by_subject: dict[str, list[dict[str, Any]]] = {}
    colors = [(200, 30, 30), (30, 30, 200)]
    for subject, n, question, options, answer, qtype, n_images in MMMU_ROWS:
        row = {
            "id": f"{split}_{subject}_{n}",
            "question": question,
            "options": repr(options),
            "explanation": "",
            "img_type": "['Diagrams']",
            "answer": answer,
            "topic_difficulty": "Easy",
            "question_type": qtype,
            "subfield": "toy",
        }
        for k in range(1, 8):
            row[f"image_{k}"] = _image(colors[k - 1]) if k <= n_images else None
        by_subject.setdefault(subject, []).append(row)
    for subject, rows in by_subject.items():
        ds = datasets.Dataset.from_list(rows, features=features)
        (root / subject).mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(root / subject / f"{split}-00000-of-00001.parquet"))
    return root


MATHVISTA_PROBLEMS = [
    {
        "pid": "1",
        "question": "What is the largest angle?",
        "choices": ["135°", "140°", "145°", "150°"],
        "unit": None,
        "precision": None,
        "answer": "145°",
        "question_type": "multi_choice",
        "answer_type": "text",
        "metadata": {
            "language": "english",
            "source": "toy",
            "category": "math-targeted-vqa",
            "task": "geometry problem solving",
            "context": "geometry diagram",
            "grade": "high school",
            "skills": ["geometry reasoning"],
        },
    },
    {
        "pid": "2",
        "question": "How many bars are there?",
        "choices": None,
        "unit": None,
        "precision": None,
        "answer": "14",
        "question_type": "free_form",
        "answer_type": "integer",
        "metadata": {
            "language": "english",
            "source": "toy",
            "category": "general-vqa",
            "task": "figure question answering",
            "context": "bar chart",
            "grade": "elementary school",
            "skills": ["arithmetic reasoning", "statistical reasoning"],
        },
    },
    {
        "pid": "3",
        "question": "What is the length of the side?",
        "choices": None,
        "unit": "cm",
        "precision": 1,
        "answer": "1.2",
        "question_type": "free_form",
        "answer_type": "float",
        "metadata": {
            "language": "chinese",
            "source": "toy",
            "category": "math-targeted-vqa",
            "task": "geometry problem solving",
            "context": "geometry diagram",
            "grade": "college",
            "skills": ["geometry reasoning", "algebraic reasoning"],
        },
    },
    {
        "pid": "4",
        "question": "Between which two years is the peak?",
        "choices": None,
        "unit": None,
        "precision": None,
        "answer": "[2014, 2016]",
        "question_type": "free_form",
        "answer_type": "list",
        "metadata": {
            "language": "english",
            "source": "toy",
            "category": "general-vqa",
            "task": "figure question answering",
            "context": "line plot",
            "grade": "daily life",
            "skills": ["statistical reasoning"],
        },
    },
]


def write_mathvista_dir(root: Path, split: str = "testmini") -> Path:
    """Write a tiny MathVista copy in the official JSON format (``<split>.json`` + ``images/<pid>.png``)."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    data = {}
    for i, p in enumerate(MATHVISTA_PROBLEMS):
        problem = dict(p, image=f"images/{p['pid']}.png")
        _image((40 * i, 100, 100)).save(root / problem["image"])
        data[p["pid"]] = problem
    (root / f"{split}.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return root


@pytest.fixture
def mmmu_dir(tmp_path: Path) -> Path:
    return write_mmmu_dir(tmp_path / "mmmu")


@pytest.fixture
def mathvista_dir(tmp_path: Path) -> Path:
    return write_mathvista_dir(tmp_path / "mathvista")
