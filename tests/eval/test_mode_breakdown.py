"""Thinking-mode measurement (keye.eval.modes): modes used, think rates, token means, accuracy per mode,
per question type and per pass-rate bucket, multi-sample pass rates, paired comparisons, and the CLI."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from keye.cli import build_parser, main
from keye.errors import KeyeConfigError, KeyeInputError
from keye.eval import cli as eval_cli
from keye.eval import modes


class WordTokenizer:
    """One token per whitespace-separated word (a stand-in with counts checkable by eye)."""

    def __call__(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return {"input_ids": text.split()}


def _think(n_words: int, answer: str, analysis: str | None = None) -> str:
    head = f"<analysis>{analysis}</analysis>" if analysis is not None else ""
    return head + "<think>" + " ".join(f"w{i}" for i in range(n_words)) + "</think>\n" + answer


# ------------------------------------------------------------------------------------------ one reply


@pytest.mark.parametrize(
    ("raw", "mode", "label", "thought", "think_tokens"),
    [
        ("<think>a b c</think>\nB", "think", "think", True, 3),
        ("<think></think>\nB", "no_think", "direct", False, 0),  # an empty block is a direct answer
        ("B", "no_think", "direct", False, 0),
        ("<analysis>easy, answer directly</analysis>B", "auto_no_think", "auto → direct", False, 0),
        ("<analysis>needs counting</analysis><think>x y</think>3", "auto_think", "auto → think", True, 2),
    ],
)
def test_reply_stats_modes_and_think_tokens(raw, mode, label, thought, think_tokens) -> None:
    stats = modes.reply_stats(raw, reply_tokens=9, tokenizer=WordTokenizer())
    assert stats == {
        "mode": mode,
        "label": label,
        "thought": thought,
        "reply_tokens": 9,
        "think_tokens": think_tokens,
    }


def test_reply_stats_without_counts_and_describe() -> None:
    s = modes.reply_stats("<think>a b</think>7")
    assert s["reply_tokens"] is None and s["think_tokens"] is None  # no tokenizer, a block to count
    assert modes.describe_reply(s) == "mode: think"
    assert modes.reply_stats("7")["think_tokens"] == 0
    # re-tokenised when no generated count is given: "<think>a", "b</think>7" are 2 words
    assert modes.reply_stats("<think>a b</think>7", tokenizer=WordTokenizer())["reply_tokens"] == 2
    assert modes.describe_reply(modes.reply_stats("B", reply_tokens=1)) == "mode: direct · 1 token"
    auto = modes.reply_stats(_think(30, "3", "hard"), reply_tokens=42, tokenizer=WordTokenizer())
    assert modes.describe_reply(auto) == "mode: auto → think · 42 tokens (30 thinking)"


# ------------------------------------------------------------------------------------------ breakdown

# (id, question_type, raw reply, gold, reply_tokens): think blocks of 12 and 20 words.
RUN = [
    ("q1", "count", _think(12, "3", "count them"), "3", 20),
    ("q2", "count", _think(20, "4", "count them"), "5", 30),
    ("q3", "color", "<analysis>direct</analysis>red", "red", 5),
    ("q4", "color", "<analysis>direct</analysis>blue", "blue", 3),
    ("q5", "color", "<analysis>direct</analysis>red", "green", 4),
    ("q6", "count", "<analysis>direct</analysis>2", "7", 6),
]


def _records():
    return [
        {"id": i, "question_type": t, "raw_output": raw, "reply_tokens": n} for i, t, raw, _, n in RUN
    ]


def _verdicts():
    return {i: raw.rsplit(">", 1)[-1].strip() == gold for i, _, raw, gold, _ in RUN}


def test_breakdown_on_constructed_records() -> None:
    rows = modes.scored_rows(_records(), _verdicts(), tokenizer=WordTokenizer())
    assert [r["mode"] for r in rows] == ["auto_think"] * 2 + ["auto_no_think"] * 4
    assert [r["think_tokens"] for r in rows] == [12, 20, 0, 0, 0, 0]
    b = modes.mode_breakdown(rows, requested_mode="auto")
    # by hand: 2 of 6 thought; q1, q3, q4 right; tokens 68 / 6; think tokens 32 / 6
    assert b["overall"]["replies"] == 6
    assert b["overall"]["think_rate"] == pytest.approx(2 / 6)
    assert b["overall"]["accuracy"] == pytest.approx(3 / 6)
    assert b["overall"]["mean_reply_tokens"] == pytest.approx(68 / 6)
    assert b["overall"]["mean_think_tokens"] == pytest.approx(32 / 6)
    assert list(b["mode_used"]) == ["auto_think", "auto_no_think"]
    assert b["mode_used"]["auto_think"]["accuracy"] == pytest.approx(0.5)
    assert b["mode_used"]["auto_think"]["mean_reply_tokens"] == pytest.approx(25.0)
    assert b["mode_used"]["auto_no_think"]["accuracy"] == pytest.approx(0.5)
    assert b["mode_used"]["auto_no_think"]["mean_reply_tokens"] == pytest.approx(4.5)
    count, color = b["group"]["count"], b["group"]["color"]
    assert list(b["group"]) == ["color", "count"]
    assert (count["think_rate"], count["accuracy"]) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert (count["accuracy_think"], count["accuracy_direct"]) == (0.5, 0.0)
    assert (color["think_rate"], color["accuracy_think"]) == (0.0, None)
    assert color["accuracy_direct"] == pytest.approx(2 / 3)
    assert b["difficulty"] is None

    tables = modes.breakdown_tables(b)
    assert tables["thinking mode"][0] == {
        "mode used": "all (requested: auto)",
        "replies": 6,
        "share %": 100.0,
        "think rate %": 33.33,
        "accuracy %": 50.0,
        "mean reply tokens": 11.3,
        "mean think tokens": 5.3,
    }
    assert tables["thinking mode"][1]["mode used"] == "auto_think (auto → think)"
    assert tables["thinking mode"][1]["share %"] == 33.33
    assert tables["thinking mode by question_type"][1]["accuracy thinking %"] == 50.0


def test_token_means_need_every_count() -> None:
    records = _records()
    del records[0]["reply_tokens"]
    rows = modes.scored_rows(records, _verdicts())  # no tokenizer: q1 has neither count
    b = modes.mode_breakdown(rows)
    assert b["overall"]["mean_reply_tokens"] is None and b["overall"]["mean_think_tokens"] is None
    assert b["mode_used"]["auto_no_think"]["mean_reply_tokens"] == pytest.approx(4.5)
    assert modes.breakdown_tables(b)["thinking mode"][0]["mode used"] == "all (requested: none (model default))"


def test_scored_rows_skip_unscored_and_reject_textless() -> None:
    rows = modes.scored_rows(_records(), {"q3": True})
    assert [r["id"] for r in rows] == ["q3"] and rows[0]["group"] == "color"
    with pytest.raises(KeyeInputError, match="no 'raw_output'"):
        modes.scored_rows([{"id": "x"}], {"x": True})
    assert modes.correct_map({"a": {"correct": 1}, "b": {"true_false": False}}) == {"a": True, "b": False}
    with pytest.raises(KeyeInputError, match="no 'correct'"):
        modes.correct_map({"a": {"prediction": "B"}})


# ------------------------------------------------------------------------------------------ difficulty


@pytest.mark.parametrize(
    ("p", "edges", "bucket"),
    [
        (1.0, (0.25, 0.75), "easy"),
        (0.75, (0.25, 0.75), "easy"),
        (0.7499, (0.25, 0.75), "medium"),
        (0.25, (0.25, 0.75), "medium"),
        (0.2499, (0.25, 0.75), "hard"),
        (0.0, (0.25, 0.75), "hard"),
        (None, (0.25, 0.75), "unrated"),
        (0.8, (0.5, 0.9), "medium"),
        (0.4, (0.5, 0.9), "hard"),
    ],
)
def test_bucket_edges(p, edges, bucket) -> None:
    assert modes.bucket_of(p, edges) == bucket


@pytest.mark.parametrize("edges", [(0.75, 0.25), (0.0, 0.5), (0.5, 1.5), (0.5,)])
def test_bad_edges(edges) -> None:
    with pytest.raises(KeyeConfigError, match="edges"):
        modes.check_edges(edges)


def test_samples_pass_rates_and_buckets() -> None:
    items = [{"id": "a", "x": 1}, {"id": "b", "x": 2}]
    expanded = modes.expand_samples(items, 4)
    assert [e["id"] for e in expanded[:5]] == ["a#s0", "a#s1", "a#s2", "a#s3", "b#s0"]
    assert {e["question_id"] for e in expanded} == {"a", "b"} and expanded[6]["sample"] == 2
    assert [e["id"] for e in modes.expand_samples(items, 1)] == ["a", "b"]
    with pytest.raises(KeyeConfigError, match="samples"):
        modes.expand_samples(items, 0)
    # a: 3 of 4 right; b: 1 of 4; c (one sample, question id taken from the id suffix): 0 of 1
    outcomes = [True, True, False, True, False, False, True, False]
    rows = [
        {"id": e["id"], "question_id": e["question_id"], "correct": ok} for e, ok in zip(expanded, outcomes)
    ]
    rows.append({"id": "c#s0", "correct": False})
    rates = modes.pass_rates(rows)
    assert rates == {
        "a": {"passed": 3, "samples": 4, "pass_rate": 0.75},
        "b": {"passed": 1, "samples": 4, "pass_rate": 0.25},
        "c": {"passed": 0, "samples": 1, "pass_rate": 0.0},
    }
    scored = [
        {**r, "question_id": modes.question_id(r), "group": None, "mode": "no_think", "thought": k % 2 == 0,
         "reply_tokens": 10, "think_tokens": 0}
        for k, r in enumerate(rows)
    ]
    b = modes.mode_breakdown(scored, rates={"a": 0.75, "b": 0.25}, edges=(0.25, 0.75))
    easy, medium, unrated = b["difficulty"]["easy"], b["difficulty"]["medium"], b["difficulty"]["unrated"]
    assert (easy["questions"], easy["replies"], easy["accuracy"]) == (1, 4, 0.75)
    assert (medium["questions"], medium["replies"], medium["accuracy"]) == (1, 4, 0.25)
    assert easy["think_rate"] == 0.5 and b["difficulty"]["hard"]["replies"] == 0
    assert (unrated["questions"], unrated["replies"]) == (1, 1)
    table = modes.breakdown_tables(b)["difficulty (pass-rate buckets)"]
    assert [(r["bucket"], r["pass rate"]) for r in table] == [
        ("easy", "p >= 0.75"),
        ("medium", "0.25 <= p < 0.75"),
        ("hard", "p < 0.25"),
        ("unrated", "no reference"),
    ]


def test_load_pass_rates_formats(tmp_path) -> None:
    (tmp_path / "modes.json").write_text(json.dumps({"pass_rates": {"a": {"pass_rate": 0.5}, "b": {"pass_rate": 1}}}))
    assert modes.load_pass_rates(tmp_path / "modes.json") == {"a": 0.5, "b": 1.0}
    (tmp_path / "plain.json").write_text(json.dumps({"a": 0.25}))
    assert modes.load_pass_rates(tmp_path / "plain.json") == {"a": 0.25}
    judged = [{"id": "a#s0", "correct": True}, {"id": "a#s1", "correct": False}, {"id": "b", "true_false": True}]
    (tmp_path / "j.jsonl").write_text("".join(json.dumps(r) + "\n" for r in judged))
    assert modes.load_pass_rates(tmp_path / "j.jsonl") == {"a": 0.5, "b": 1.0}
    preds = [{"id": "a#s0", "response": "x"}, {"id": "a#s1", "response": "y"}, {"id": "a#s2", "response": "y"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in preds))
    score = lambda recs: {r["id"]: r["response"] == "y" for r in recs}  # noqa: E731
    assert modes.load_pass_rates(tmp_path / "p.jsonl", score=score) == {"a": pytest.approx(2 / 3)}
    with pytest.raises(KeyeInputError, match="no scorer"):
        modes.load_pass_rates(tmp_path / "p.jsonl")
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1.5}))
    with pytest.raises(KeyeInputError, match=r"\[0, 1\]"):
        modes.load_pass_rates(tmp_path / "bad.json")
    with pytest.raises(KeyeInputError, match="not found"):
        modes.load_pass_rates(tmp_path / "missing.json")


# ------------------------------------------------------------------------------------------ paired


def test_paired_diff_against_hand_computation() -> None:
    a = [{"id": q, "correct": c, "reply_tokens": t} for q, c, t in
         [("q1", 1, 10), ("q2", 1, 20), ("q3", 0, 30), ("q4", 1, 40)]]
    b = [{"id": q, "correct": c, "reply_tokens": t} for q, c, t in
         [("q1", 1, 20), ("q2", 0, 20), ("q3", 0, 40), ("q4", 0, 40), ("q5", 1, 5)]]
    r = modes.paired_diff(a, b)
    # d = [0, 1, 0, 1]: mean 0.5, sample sd sqrt(1/3), se = sd / 2
    assert r["n"] == 4 and (r["unpaired_a"], r["unpaired_b"]) == (0, 1)
    assert (r["acc_a"], r["acc_b"], r["diff"]) == (0.75, 0.25, 0.5)
    assert r["se"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert r["ci95"] == pytest.approx([0.5 - 1.96 * math.sqrt(1 / 3) / 2, 0.5 + 1.96 * math.sqrt(1 / 3) / 2])
    # tokens: 100/4 vs 120/4 -> R = 5/6; delta method sd(a_i - R b_i) / (sqrt(n) mean_b)
    assert (r["tokens_a"], r["tokens_b"]) == (25.0, 30.0)
    assert r["token_ratio"] == pytest.approx(5 / 6)
    resid = [10 - 5 / 6 * 20, 20 - 5 / 6 * 20, 30 - 5 / 6 * 40, 40 - 5 / 6 * 40]
    assert r["token_ratio_se"] == pytest.approx(statistics.stdev(resid) / (2 * 30.0))
    row = modes.paired_table(r, "auto", "think")[0]
    assert row["a - b (points)"] == 50.0 and row["paired SE (points)"] == pytest.approx(28.87)


def test_paired_diff_averages_samples_and_reports_errors() -> None:
    a = [{"id": "q1#s0", "correct": True}, {"id": "q1#s1", "correct": False}, {"id": "q2#s0", "correct": True},
         {"id": "q2#s1", "correct": True}]
    b = [{"id": "q1", "correct": False}, {"id": "q2", "correct": True}]
    r = modes.paired_diff(a, b)
    # per question a = [0.5, 1.0], b = [0, 1]: d = [0.5, 0], mean 0.25, sd sqrt(0.125), se = sd / sqrt(2)
    assert r["diff"] == pytest.approx(0.25) and r["se"] == pytest.approx(math.sqrt(0.125) / math.sqrt(2))
    assert r["token_ratio"] is None  # no counts
    assert modes.paired_diff(a[:2], b[:1])["se"] is None  # one pair: no spread to estimate
    with pytest.raises(KeyeInputError, match="share no question"):
        modes.paired_diff(a, [{"id": "z", "correct": True}])
    with pytest.raises(KeyeInputError, match="verdict"):
        modes.paired_diff([{"id": "q1"}], b)


# ------------------------------------------------------------------------------------------ runner


def test_keye_engine_counts_generated_tokens_to_the_first_eos() -> None:
    import torch

    from keye.eval.runner import KeyeEngine

    class Proc:
        tokenizer = WordTokenizer()

        def __call__(self, conversations, return_tensors="pt", mode=None):
            return {"input_ids": torch.zeros(len(conversations), 2, dtype=torch.long)}

        def batch_decode(self, ids, skip_special_tokens=True):
            return ["<think>a b c</think>B" if int(row[0]) == 5 else "B" for row in ids]

    class Model(torch.nn.Module):
        class config:  # noqa: N801 - mirrors KeyeVL.config
            eos_token_ids = [9]

        def generate(self, input_ids, **kwargs):
            # row 0 stops after 3 tokens (EOS, then padding 9s); row 1 runs out of budget
            new = torch.tensor([[5, 6, 9, 9, 9], [1, 2, 3, 4, 5]])[: input_ids.shape[0]]
            return torch.cat([input_ids, new], dim=1)

    engine = KeyeEngine(Model(), Proc(), batch_size=2, max_new_tokens=5)
    assert engine.generate([[{"role": "user", "content": "x"}]] * 2) == ["<think>a b c</think>B", "B"]
    assert engine.last_token_stats == [
        {"reply_tokens": 3, "think_tokens": 3},
        {"reply_tokens": 5, "think_tokens": 0},
    ]


# ------------------------------------------------------------------------------------------ CLI


class SampleEngine:
    """Answers copy k of a question (samples are adjacent) with pattern k % 3: think + 7, direct 7, A.
    Reports token counts the way KeyeEngine does."""

    ANSWERS = ("<think>one two three</think>\n7", "7", "A")
    TOKENS = (6, 2, 2)

    def __init__(self):
        self.n = 0
        self.calls = 0

    def generate(self, conversations, **kwargs):
        self.calls += 1
        ks = [(self.n + i) % 3 for i in range(len(conversations))]
        self.n += len(conversations)
        self.last_token_stats = [{"reply_tokens": self.TOKENS[k], "think_tokens": 3 if k == 0 else 0} for k in ks]
        return [self.ANSWERS[k] for k in ks]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    from keye.data.synth import generate_split

    return generate_split(tmp_path_factory.mktemp("synth"), "test", 5, seed=3, workers=0, progress=False)


def test_synth_samples_give_pass_rates_and_resume(manifest, tmp_path) -> None:
    from keye.eval import synth

    out = tmp_path / "run"
    argv = ["eval", "synth", "--model", "fake", "--data", str(manifest), "--out", str(out), "--no-progress",
            "--samples", "3", "--sampling", "keye", "--mode", "auto", "--batch-size", "2"]
    engine = SampleEngine()
    assert eval_cli.cmd_synth(build_parser().parse_args(argv), engine=engine) == 0
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 15 and preds[4]["id"].endswith("#s1") and preds[4]["sample"] == 1
    assert [p["reply_tokens"] for p in preds[:3]] == [6, 2, 2]
    items = {it["id"]: it for it in synth.load_items(manifest)}
    doc = json.loads((out / "modes.json").read_text())
    assert doc["difficulty_source"] == "this run"
    for qid, item in items.items():
        # independent expectation: which of the three fixed answers the scorer accepts for this item
        expected = sum(synth.is_correct(synth.extract(a, item), item) for a in ("7", "7", "A"))
        assert doc["pass_rates"][qid] == {"passed": expected, "samples": 3, "pass_rate": expected / 3}
    overall = doc["breakdown"]["overall"]
    assert overall["replies"] == 15 and overall["think_rate"] == pytest.approx(1 / 3)
    assert overall["mean_reply_tokens"] == pytest.approx(10 / 3) and overall["mean_think_tokens"] == 1.0
    assert sum(b["questions"] for b in doc["breakdown"]["difficulty"].values()) == 5
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["samples"] == 3
    assert list(report["tables"])[:3] == ["question_type", "answer_kind", "modality"]  # unchanged, then ours
    assert "difficulty (pass-rate buckets)" in report["tables"]
    assert "## thinking mode by question_type" in (out / "report.md").read_text()
    rows = [json.loads(line) for line in (out / "modes.jsonl").read_text().splitlines()]
    assert len(rows) == 15 and {r["mode"] for r in rows} == {"think", "no_think"}
    # resume: every sample is stored, nothing is asked again
    again = SampleEngine()
    assert eval_cli.cmd_synth(build_parser().parse_args(argv), engine=again) == 0
    assert again.calls == 0
    # a greedy single-answer run bucketed by the multi-sample run
    out2 = tmp_path / "greedy"
    argv2 = ["eval", "synth", "--model", "fake", "--data", str(manifest), "--out", str(out2), "--no-progress",
             "--difficulty-from", str(out / "modes.json")]
    assert eval_cli.cmd_synth(build_parser().parse_args(argv2), engine=SampleEngine()) == 0
    doc2 = json.loads((out2 / "modes.json").read_text())
    assert doc2["difficulty_source"] == str(out / "modes.json")
    buckets = doc2["breakdown"]["difficulty"]
    expected_buckets = [modes.bucket_of(doc["pass_rates"][q]["pass_rate"]) for q in items]
    for name in ("easy", "medium", "hard"):
        assert buckets[name]["questions"] == expected_buckets.count(name)
    # the same run bucketed from the reference's raw predictions (scored again) agrees
    argv3 = [a if a != str(out / "modes.json") else str(out / "predictions.jsonl") for a in argv2]
    argv3[argv3.index(str(out2))] = str(tmp_path / "greedy3")
    assert eval_cli.cmd_synth(build_parser().parse_args(argv3), engine=SampleEngine()) == 0
    doc3 = json.loads((tmp_path / "greedy3" / "modes.json").read_text())
    assert doc3["breakdown"]["difficulty"] == buckets
    # compare the two runs (modes.jsonl carry verdicts and tokens)
    cmp_out = tmp_path / "cmp.json"
    assert main(["eval", "compare", str(out / "modes.jsonl"), str(out2 / "modes.jsonl"), "--out", str(cmp_out)]) == 0
    result = json.loads(cmp_out.read_text())
    a_rows = [json.loads(line) for line in (out / "modes.jsonl").read_text().splitlines()]
    b_rows = [json.loads(line) for line in (out2 / "modes.jsonl").read_text().splitlines()]
    assert result["n"] == 5 and result["diff"] == pytest.approx(modes.paired_diff(a_rows, b_rows)["diff"])
    # and from the raw predictions, scored by the synth scorer: the same numbers
    assert main(["eval", "compare", str(out / "predictions.jsonl"), str(out2 / "predictions.jsonl"),
                 "--out", str(tmp_path / "cmp2.json")]) == 0
    result2 = json.loads((tmp_path / "cmp2.json").read_text())
    assert result2["diff"] == pytest.approx(result["diff"]) and result2["se"] == pytest.approx(result["se"])


def test_samples_need_sampling(manifest, tmp_path, capsys) -> None:
    argv = ["eval", "synth", "--model", "fake", "--data", str(manifest), "--out", str(tmp_path / "r"),
            "--samples", "2"]
    assert main(argv) == 1
    assert "--sampling keye" in capsys.readouterr().err


def test_rescoring_counts_tokens_with_a_tokenizer(manifest, tmp_path, capsys) -> None:
    from tests.eval.conftest import CannedEngine

    out = tmp_path / "run"
    args = build_parser().parse_args(
        ["eval", "synth", "--model", "fake", "--data", str(manifest), "--out", str(out), "--no-progress"]
    )
    assert eval_cli.cmd_synth(args, engine=CannedEngine(lambda t: "<think>two words</think>\n3")) == 0
    doc = json.loads((out / "modes.json").read_text())
    assert doc["breakdown"]["overall"]["think_rate"] == 1.0
    assert doc["breakdown"]["overall"]["mean_reply_tokens"] is None  # a fake engine reports no counts
    assert doc["difficulty_source"] is None and doc["breakdown"]["difficulty"] is None
    rescored = tmp_path / "rescored"
    argv = ["eval", "score", "synth", str(out / "predictions.jsonl"), "--out", str(rescored),
            "--tokenizer", "keye-tiny"]
    assert main(argv) == 0
    doc2 = json.loads((rescored / "modes.json").read_text())
    from keye.processing.processor import KeyeProcessor
    from keye.tiny import tiny_dir

    tok = KeyeProcessor.from_pretrained(tiny_dir()).tokenizer
    n_reply = len(tok("<think>two words</think>\n3", add_special_tokens=False)["input_ids"])
    n_think = len(tok("two words", add_special_tokens=False)["input_ids"])
    assert doc2["breakdown"]["overall"]["mean_reply_tokens"] == n_reply
    assert doc2["breakdown"]["overall"]["mean_think_tokens"] == n_think
    assert doc2["breakdown"]["requested_mode"] == "unknown (re-scored)"


def test_keye_tiny_samples(manifest, tmp_path) -> None:
    """keye-tiny answers 2 questions x 3 samples: pass rates in [0, 1] over 3 samples, token counts stored."""
    out = tmp_path / "tiny"
    argv = ["eval", "synth", "--model", "keye-tiny", "--data", str(manifest), "--out", str(out), "--limit", "2",
            "--samples", "3", "--sampling", "keye", "--seed", "0", "--mode", "auto", "--max-new-tokens", "16",
            "--batch-size", "6", "--no-progress"]
    assert main(argv) == 0
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 6
    assert all(1 <= p["reply_tokens"] <= 16 and p["think_tokens"] >= 0 for p in preds)
    doc = json.loads((out / "modes.json").read_text())
    assert len(doc["pass_rates"]) == 2
    for entry in doc["pass_rates"].values():
        assert entry["samples"] == 3 and 0.0 <= entry["pass_rate"] <= 1.0
        assert entry["pass_rate"] == entry["passed"] / 3
    scores = json.loads((out / "scores.json").read_text())
    assert scores["overall"]["correct"] == sum(e["passed"] for e in doc["pass_rates"].values())
