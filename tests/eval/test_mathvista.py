"""MathVista: official normalisation (docs/evaluation.md 2.4 / 2.6), extraction fast paths, the LLM-judge
path over HTTP, the rule-based extractor, the query and local loading."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from keye.errors import KeyeInputError
from keye.eval import mathvista as mv

ANGLES = ["135°", "140°", "145°", "150°"]

# (extraction, question_type, answer_type, choices, precision, normalised, gold, correct)
NORMALISE_CASES = [
    # spec 2.6 table
    ("C", "multi_choice", "text", ANGLES, None, "145°", "145°", True),
    ("(C) 145°", "multi_choice", "text", ANGLES, None, "145°", "145°", True),
    ("The answer is (c)", "multi_choice", "text", ANGLES, None, "145°", "145°", True),
    ("c", "multi_choice", "text", ANGLES, None, "135°", "145°", False),
    ("145", "multi_choice", "text", ANGLES, None, "145°", "145°", True),
    ("", "multi_choice", "text", ANGLES, None, "135°", "145°", False),
    ("E", "multi_choice", "text", ANGLES, None, "135°", "145°", False),
    ("14.6", "free_form", "integer", None, None, "14", "14", True),
    ("1,000", "free_form", "integer", None, None, None, "1000", False),
    ("1e3", "free_form", "integer", None, None, "1000", "1000", True),
    ("1.25", "free_form", "float", None, 1, "1.2", "1.2", True),
    ("2.675", "free_form", "float", None, 2, "2.67", "2.68", False),
    ("47.6%", "free_form", "float", None, 1, None, "47.6", False),
    ("[2014,2016]", "free_form", "list", None, None, "[2014,2016]", "[2014, 2016]", False),
    # derived from the rules
    ("[2014, 2016]", "free_form", "list", None, None, "[2014, 2016]", "[2014, 2016]", True),
    ("  B  ", "multi_choice", "text", ANGLES, None, "140°", "140°", True),  # trimmed before the letter test
    (
        "(x) (B)",
        "multi_choice",
        "text",
        ANGLES,
        None,
        "135°",
        "140°",
        False,
    ),  # first (x) wins: X is no option
    ("-3.9", "free_form", "integer", None, None, "-3", "-3", True),  # truncation toward zero
    ("7", "free_form", "float", None, 1.0, "7.0", "7.0", True),  # HF stores precision as float64
    ("7", "free_form", "float", None, None, None, "7.0", False),  # no precision: the conversion fails
    (14, "free_form", "integer", None, None, "14", "14", True),  # non-string extraction
    ("14 ", "free_form", "integer", None, None, "14", "14 ", False),  # no trimming of the gold
]


@pytest.mark.parametrize(
    "extraction, qtype, atype, choices, precision, normalised, gold, correct", NORMALISE_CASES
)
def test_normalise_table(extraction, qtype, atype, choices, precision, normalised, gold, correct) -> None:
    got = mv.normalize_extracted_answer(extraction, choices, qtype, atype, precision)
    assert got == normalised
    assert mv.safe_equal(got, gold) is correct


def test_ignore_empty_extractions() -> None:
    assert (
        mv.normalize_extracted_answer("", ANGLES, "multi_choice", "text", None, ignore_empty_extractions=True)
        is None
    )
    assert (
        mv.normalize_extracted_answer(
            " ", ANGLES, "multi_choice", "text", None, ignore_empty_extractions=True
        )
        is None
    )


def _problem(atype="integer", qtype="free_form", choices=None, precision=None, **kw):
    return {
        "pid": "9",
        "question": "Q?",
        "choices": choices,
        "unit": None,
        "precision": precision,
        "answer": kw.pop("answer", "0"),
        "question_type": qtype,
        "answer_type": atype,
        **kw,
    }


MC = _problem("text", "multi_choice", ANGLES)
INT = _problem("integer")
FLT1 = _problem("float", precision=1)
LST = _problem("list")
TXT = _problem("text")


class FailingJudge:
    def __call__(self, prompt: str) -> str:
        raise AssertionError("the fast paths must not reach the judge")


FAST_PATH_CASES = [
    ("", MC, ""),
    ("145°", MC, "145°"),
    (" 14\n", INT, "14"),
    ("-3", INT, "-3"),
    ("1.5", FLT1, "1.5"),
    ("1e1", FLT1, "10.0"),
    (" 2.50 ", FLT1, "2.5"),
]


@pytest.mark.parametrize("response, problem, expected", FAST_PATH_CASES)
def test_extract_fast_paths(response, problem, expected) -> None:
    assert mv.extract_answer(response, problem, judge=FailingJudge()) == expected


def test_quick_extract() -> None:
    assert mv.extract_answer('The answer is "7".', INT, judge=FailingJudge(), quick_extract=True) == "7"


# The rule-based extractor used without a judge (ours; see rule_extract's docstring).
RULE_CASES = [
    ("The answer is C.", MC, "C"),
    ("**B**", MC, "B"),
    ("I think it's (D) 150°", MC, "(D)"),
    ("A cat is in the figure; the angle is 145°", MC, "145°"),  # capital article is not option A
    ("It's between 140° and 145°, I'd say 145°", MC, "145°"),
    ("The correct option is B. 140°", MC, "B"),
    ("none of them", MC, "none of them"),
    ("There are 14 bars.", INT, "14"),
    ("The answer is 1,000 people", INT, "1000"),
    ("so 3 + 4 = 7", INT, "7"),
    ("Answer: -5", INT, "-5"),
    ("The answer is 12. Earlier I said 10.", INT, "12"),  # the tail after the cue comes first
    ("no idea", INT, "no idea"),
    ("The length is 1.25 cm", FLT1, "1.25"),
    ("Final answer: 3/4", FLT1, "0.75"),
    ("x = 2.5e1", FLT1, "2.5e1"),
    ("The years are [2014,2016]", LST, "[2014, 2016]"),
    ("between 2014 and 2016", LST, "[2014, 2016]"),
    ("[ 1.2 , 3 ]", LST, "[1.2, 3]"),
    ("The answer is Paris.", TXT, "Paris"),
]


@pytest.mark.parametrize("response, problem, expected", RULE_CASES)
def test_rule_extract_table(response, problem, expected) -> None:
    assert mv.extract_answer(response, problem) == expected


def test_rule_extract_then_official_score() -> None:
    record = dict(MC, id="9", pid="9", answer="145°", metadata={"task": "t"}, response="I pick (C).")
    scores, per_item = mv.score_records([record])
    assert per_item["9"] == {"prediction": "145°", "true_false": True, "extraction": "(C)"}
    assert scores["average"]["correct"] == 1 and scores["task"] == {
        "t": {"accuracy": 1.0, "correct": 1, "total": 1}
    }


def test_judge_prompt_and_failure() -> None:
    seen = []

    def judge(prompt: str) -> str:
        seen.append(prompt)
        return "B"

    assert mv.extract_answer("Clearly the second one.", MC, judge=judge) == "B"
    prompt = seen[0]
    assert prompt.startswith("Please read the following example.")
    assert prompt.endswith(f"{mv.build_query(MC)}\n\nClearly the second one.\n\nExtracted answer: ")
    assert "Extracted answer: [2007, 2008]" in prompt

    def broken(prompt: str) -> str:
        raise KeyeInputError("down")

    assert mv.extract_answer("Clearly the second one.", MC, judge=broken) == ""


class _Handler(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802 - http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.requests.append((self.path, self.headers.get("Authorization"), body))
        payload = json.dumps({"choices": [{"message": {"content": " 145° "}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        return


def test_openai_judge_over_http() -> None:
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        judge = mv.OpenAIJudge(f"http://127.0.0.1:{server.server_port}/v1", model="judge-x", api_key="k")
        assert judge("hello") == "145°"
        path, auth, body = _Handler.requests[-1]
        assert path == "/v1/chat/completions" and auth == "Bearer k"
        assert body["model"] == "judge-x" and body["messages"] == [{"role": "user", "content": "hello"}]
        assert body["temperature"] == 0
    finally:
        server.shutdown()
        server.server_close()
    dead = mv.OpenAIJudge(f"http://127.0.0.1:{server.server_port}/v1/chat/completions", timeout=2)
    with pytest.raises(KeyeInputError, match="judge request failed"):
        dead("hello")
    assert mv.extract_answer("Clearly the third.", MC, judge=dead) == ""


def test_build_query_and_errors() -> None:
    p = _problem("float", precision=2, unit="cm", question="How long?")
    assert mv.build_query(p) == mv.HINT_FLOAT_2 + "\nQuestion: How long? (Unit: cm)"
    assert mv.build_query(_problem("list", question="Which?")) == mv.HINT_LIST + "\nQuestion: Which?"
    assert mv.build_query(dict(MC, choices=["x", "y "])).endswith("Choices:\n(A) x\n(B) y")
    with pytest.raises(KeyeInputError):
        mv.build_query(_problem("float", precision=3))
    with pytest.raises(KeyeInputError):
        mv.build_query(_problem("matrix"))


def test_load_json_copy_and_conversation(mathvista_dir) -> None:
    problems = mv.load_mathvista("testmini", data_dir=mathvista_dir)
    assert [p["pid"] for p in problems] == ["1", "2", "3", "4"]
    assert problems[2]["query"].endswith("Question: What is the length of the side? (Unit: cm)")
    conv = mv.build_conversation(problems[0])
    image, text = conv[0]["content"]
    assert image["image"].size == (56, 56) and text["text"] == problems[0]["query"]
    with pytest.raises(KeyeInputError, match="no 'test-"):
        mv.load_mathvista("test", data_dir=mathvista_dir)


def test_load_parquet_copy(tmp_path) -> None:
    import datasets
    from PIL import Image

    rows = [
        {
            "pid": "7",
            "question": "How many?",
            "image": "images/7.jpg",
            "decoded_image": Image.new("RGB", (60, 40), (1, 2, 3)),
            "choices": None,
            "unit": None,
            "precision": None,
            "answer": "3",
            "question_type": "free_form",
            "answer_type": "integer",
            "metadata": {"language": "english", "skills": ["arithmetic reasoning"]},
            "query": "Hint: ...\nQuestion: How many?",
        }
    ]
    features = datasets.Features(
        {
            "pid": datasets.Value("string"),
            "question": datasets.Value("string"),
            "image": datasets.Value("string"),
            "decoded_image": datasets.Image(),
            "choices": datasets.Sequence(datasets.Value("string")),
            "unit": datasets.Value("string"),
            "precision": datasets.Value("float64"),
            "answer": datasets.Value("string"),
            "question_type": datasets.Value("string"),
            "answer_type": datasets.Value("string"),
            "metadata": {
                "language": datasets.Value("string"),
                "skills": datasets.Sequence(datasets.Value("string")),
            },
            "query": datasets.Value("string"),
        }
    )
    (tmp_path / "data").mkdir()
    datasets.Dataset.from_list(rows, features=features).to_parquet(
        str(tmp_path / "data" / "testmini-00000-of-00001.parquet")
    )
    (problem,) = mv.load_mathvista("testmini", data_dir=tmp_path)
    assert problem["query"] == "Hint: ...\nQuestion: How many?"
    assert mv.problem_image(problem).size == (60, 40)
    assert problem["metadata"]["skills"] == ["arithmetic reasoning"]


def test_missing_fields_are_named() -> None:
    with pytest.raises(KeyeInputError, match="extraction"):
        mv.calculate_score({"5": {"answer": "1", "question_type": "free_form", "answer_type": "integer"}})
    with pytest.raises(KeyeInputError, match="neither"):
        mv.score_records(
            [{"pid": "5", "answer": "1", "question_type": "free_form", "answer_type": "integer"}]
        )


def test_offline_without_local_copy_is_a_clear_error(monkeypatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(KeyeInputError, match="cannot load AI4Math/MathVista split 'testmini'.*--data"):
        mv.load_mathvista("testmini")
    from keye.eval import mmmu

    with pytest.raises(KeyeInputError, match="cannot load MMMU/MMMU config 'Art'.*--data"):
        mmmu.load_mmmu("validation", subjects=["Art"])
