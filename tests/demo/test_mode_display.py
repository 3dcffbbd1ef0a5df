"""The demo and ``keye chat`` show which mode the model chose and how many tokens it spent (no browser)."""

from __future__ import annotations

import json
import re

import pytest

from keye.demo import chat
from keye.demo.app import _turn_messages, make_respond
from keye.demo.engine import ModelHost
from keye.demo.session import reply_stats


class WordTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_turn_messages_show_mode_and_tokens_under_the_answer():
    thought = reply_stats("<think>a b c</think>\nB", 5, WordTokenizer())
    assert thought["line"] == "mode: think · 5 tokens (3 thinking)"
    msgs = _turn_messages("q", "<think>a b c</think>\nB", True, thought)
    assert msgs[1]["metadata"] == {"title": "Thinking · 3 tokens", "status": "done"}
    assert msgs[1]["content"] == "a b c"
    assert msgs[2] == {"role": "assistant", "content": "B\n\n<sub>mode: think · 5 tokens (3 thinking)</sub>"}

    direct = reply_stats("B", 1, WordTokenizer())
    assert _turn_messages("q", "B", True, direct)[1]["content"] == "B\n\n<sub>mode: direct · 1 token</sub>"

    auto = reply_stats("<analysis>simple</analysis>B", 4, WordTokenizer())
    msgs = _turn_messages("q", "<analysis>simple</analysis>B", True, auto)
    # the analysis is shown in the collapsible block; the title has no think tokens (it did not think)
    assert msgs[1]["metadata"]["title"] == "Thinking" and msgs[1]["content"] == "simple"
    assert msgs[2]["content"].endswith("<sub>mode: auto → direct · 4 tokens</sub>")
    # while streaming (no stats) nothing is added
    assert _turn_messages("q", "B", False)[1] == {"role": "assistant", "content": "B"}


def _fake_stream(pieces, n_tokens):
    def stream(model, processor, batch, sampling, stats=None):
        if stats is not None:
            stats["tokens"] = n_tokens
        yield from pieces

    return stream


@pytest.fixture(scope="module")
def host(tiny_ckpt):
    return ModelHost(str(tiny_ckpt), device="cpu").load_now()


def test_respond_final_answer_carries_the_mode_line(host, clip, monkeypatch):
    monkeypatch.setattr(
        "keye.demo.app.stream_reply", _fake_stream(["<think>one two", " three</think>", "\nB"], 7)
    )
    args = ([str(clip)], "What moves?", None, 2.0, 4, 1024, True, 0.9, "think", True, 0.7, 0.9, 50, 8, 1.0)
    *_, final = list(make_respond(host, None)(*args))
    chatbot, summary = final[0], final[4]
    n_think = len(host.processor.tokenizer("one two three", add_special_tokens=False)["input_ids"])
    assert chatbot[1]["metadata"] == {"title": f"Thinking · {n_think} tokens", "status": "done"}
    assert chatbot[2]["content"] == f"B\n\n<sub>mode: think · 7 tokens ({n_think} thinking)</sub>"
    assert "**Generated:** 7 tokens" in summary


def test_respond_with_the_real_model_counts_generated_tokens(host, clip):
    args = ([str(clip)], "What moves?", None, 2.0, 4, 1024, True, 0.9, "auto", True, 0.7, 0.9, 50, 5, 1.0)
    *_, final = list(make_respond(host, None)(*args))
    chatbot, summary = final[0], final[4]
    line = re.search(r"<sub>mode: (.*) · (\d+) tokens?( \(\d+ thinking\))?</sub>$", chatbot[-1]["content"])
    assert line is not None, chatbot[-1]
    generated = int(re.search(r"\*\*Generated:\*\* (\d+) tokens", summary).group(1))
    assert int(line.group(2)) == generated and 1 <= generated <= 5
    has_block = any("metadata" in m for m in chatbot)
    assert line.group(1) in (("think", "auto → think", "auto → direct") if has_block else ("direct",))


def test_chat_prints_the_mode_line(tiny_ckpt, clip, capsys, monkeypatch):
    base = ["--model", str(tiny_ckpt), "--video", str(clip), "What is shown?", "--max-new-tokens", "4"]
    assert chat.main(base) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"\[mode: (direct|think|auto → think|auto → direct) · (\d+) tokens?.*\]", last)
    assert m is not None and 1 <= int(m.group(2)) <= 4, last
    assert chat.main(base + ["--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert 1 <= parsed["reply_tokens"] <= 4 and parsed["think_tokens"] >= 0

    monkeypatch.setattr("keye.demo.chat.stream_reply", _fake_stream(["<think>a b", "</think>", "3"], 6))
    assert chat.main(base) == 0
    out = capsys.readouterr().out
    tok = chat.ModelHost(str(tiny_ckpt), device="cpu").load_now().processor.tokenizer
    n_think = len(tok("a b", add_special_tokens=False)["input_ids"])
    assert out.rstrip().endswith(f"[mode: think · 6 tokens ({n_think} thinking)]")
    assert "[thinking] a b" in out
