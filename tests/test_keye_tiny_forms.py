"""What a newcomer asks the embedded default keye-tiny: free-form questions about clips it never saw
(answered with a word, not a caption), the thinking modes (``/think`` writes a trace then the answer,
``/no_think`` answers directly) through the model, ``keye chat`` and ``keye serve``, and a greeting."""

from __future__ import annotations

import json

import pytest

from keye import load_tiny
from keye.data.synth import generate_split
from keye.data.synth_answers import extract, is_correct
from keye.data.synth_forms import free_form_row
from keye.eval.runner import KeyeEngine
from keye.eval.synth import build_conversation, load_items
from keye.processing.chat import parse_response

# Clips drawn with a seed no stage of keye-tiny's build trains on (0, 11 and 13 are the build's).
SEED = 909
TYPES = ("direction", "color", "order", "shape", "count")


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def free_items(tmp_path_factory):
    out = tmp_path_factory.mktemp("free")
    rows = [json.loads(line) for line in
            generate_split(out, "test", 48, seed=SEED, workers=1, progress=False).read_text().splitlines()]
    free = [free_form_row(r) for r in rows if r["question_type"] in TYPES]
    (out / "free.jsonl").write_text("".join(json.dumps(r) + "\n" for r in free))
    return load_items(out / "free.jsonl")


def _ask(tiny, conversations, max_new_tokens=12, mode=None):
    model, proc = tiny
    return KeyeEngine(model, proc, batch_size=8, max_new_tokens=max_new_tokens, mode=mode).generate(conversations)


@pytest.mark.slow
def test_free_form_questions_are_answered_in_words(tiny, free_items):
    replies = _ask(tiny, [build_conversation(it) for it in free_items])
    correct = 0
    for reply, item in zip(replies, free_items):
        text = reply.strip()
        assert len(text.split()) <= 3 and "." not in text.rstrip("."), (text, item["id"])  # a word, not a caption
        assert extract(text, item) is not None, (text, item["id"])  # it names a candidate answer
        correct += is_correct(extract(text, item), item)
    assert len(free_items) >= 20 and correct / len(free_items) >= 0.6, (correct, len(free_items))


@pytest.mark.slow
def test_think_writes_a_trace_and_no_think_answers_directly(tiny, free_items):
    items = free_items[:8]
    conversations = [build_conversation(it) for it in items]
    for reply in _ask(tiny, conversations, max_new_tokens=96, mode="think"):
        parsed = parse_response(reply)
        assert parsed.think and parsed.think.strip() and parsed.answer.strip(), reply
        assert parsed.mode == "think"
    for reply in _ask(tiny, conversations, mode="no_think"):
        assert "<think>" not in reply and parse_response(reply).think is None and reply.strip(), reply


def test_a_greeting_gets_a_sentence_about_the_model(tiny):
    reply = _ask(tiny, [[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]], max_new_tokens=48)[0]
    assert "keye-tiny" in reply and len(reply.split()) >= 5, reply


@pytest.mark.slow
def test_keye_chat_thinks_on_the_switch_in_the_question(free_items, capsys):
    from keye.cli import main

    item = next(it for it in free_items if it["question_type"] == "direction")
    video, question = item["messages"][0]["content"][0]["video"], item["messages"][0]["content"][1]["text"]
    replies = {}
    for switch in ("/think", "/no_think"):
        assert main(["chat", "--video", str(video), "--max-new-tokens", "96", "--json", question + switch]) == 0
        replies[switch] = json.loads(capsys.readouterr().out)
    assert replies["/think"]["mode"] == "think" and replies["/think"]["think"].strip()
    assert replies["/think"]["think_tokens"] > 0
    assert replies["/no_think"]["think"] is None and replies["/no_think"]["think_tokens"] == 0
    for reply in replies.values():
        assert extract(reply["answer"], item) is not None, reply
