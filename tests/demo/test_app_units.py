"""Demo pieces that need no server: the loading state, the command line wiring."""

from __future__ import annotations

import pytest

from keye.cli import build_parser
from keye.demo.app import effective_mode, make_respond
from keye.demo.engine import ModelHost


def _respond_args(files, question):
    # files, question, state, fps, max_frames, budget, slow_fast, similarity, mode, greedy, temperature,
    # top_p, top_k, max_new_tokens, repetition_penalty
    return (files, question, None, 2.0, 32, 16384, True, 0.9, "auto", True, 0.7, 0.9, 50, 8, 1.0)


def test_questions_wait_for_a_loading_model_and_report_a_failed_load(clip):
    host = ModelHost("some/model", device="cpu")
    host.state = "loading"  # as if the background thread were still reading weights
    assert host.describe().startswith("**Loading model** `some/model`")
    gen = make_respond(host, None)(*_respond_args([str(clip)], "What moves?"))
    first = next(gen)
    assert "still loading" in first[2].value and first[5] == "What moves?"
    host.state, host.error = "failed", "weights not found"
    second = next(gen)
    assert second[2].value == "The model could not be loaded: weights not found"
    assert host.describe() == "**Model failed to load:** `some/model`: weights not found"


def test_failed_background_load_is_reported(tmp_path):
    host = ModelHost(str(tmp_path / "nowhere"), device="cpu").start()
    assert host.wait(60) is False and host.state == "failed"
    assert "nowhere" in host.error


def test_demo_command_line():
    args = build_parser().parse_args(["demo", "--port", "7999", "--model", "ckpt", "--share"])
    assert (args.port, args.model, args.share, args.host) == (7999, "ckpt", True, "127.0.0.1")
    assert callable(args.func)


def test_turn_messages_put_thinking_in_a_collapsible_block():
    from keye.demo.app import _turn_messages

    assert _turn_messages("q", "", False) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "…"},
    ]
    live = _turn_messages("q", "<think>the square is on the left", False)
    assert live[1] == {
        "role": "assistant",
        "content": "the square is on the left",
        "metadata": {"title": "Thinking", "status": "pending"},
    }
    assert len(live) == 2  # no answer bubble until the answer starts
    done = _turn_messages("q", "<think>it moves right</think>\nB", True)
    assert done[1]["metadata"]["status"] == "done" and done[2] == {"role": "assistant", "content": "B"}
    assert _turn_messages("q", "B", True) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "B"},
    ]


def _busy_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


def test_a_busy_port_is_one_line_naming_it_before_anything_loads(monkeypatch, capsys):
    from keye.cli import main

    def no_load(self):
        raise AssertionError("the model must not load when the port is busy")

    monkeypatch.setattr(ModelHost, "start", no_load)
    sock, port = _busy_port()
    with sock:
        assert main(["demo", "--port", str(port)]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # no address printed as if the page were up
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"keye: error: port {port} on 127.0.0.1 is already in use"), lines


def test_make_demo_takes_a_port():
    import subprocess

    from tests.paths import REPO_ROOT

    r = subprocess.run(["make", "-n", "-o", ".venv/.installed", "-o", ".venv/.pillow13", "demo", "PORT=7999"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "keye demo --model keye-tiny --port 7999" in r.stdout, r.stdout


def test_a_bare_number_answer_is_not_an_empty_list_item():
    markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py renders Markdown as the page does")
    from keye.demo.app import _turn_messages, markdown_safe

    md = markdown_it.MarkdownIt("commonmark")
    answer = _turn_messages("How many?", "2.", True)[-1]["content"]
    assert md.render(answer).strip() == "<p>2.</p>"
    for bare, shown in (("-", "<p>-</p>"), ("3)", "<p>3)</p>"), ("#", "<p>#</p>"), ("left\n1.", "<p>left\n1.</p>")):
        assert md.render(markdown_safe(bare)).strip() == shown, bare
    # real lists and ordinary text are left to Markdown
    assert markdown_safe("1. red\n2. blue") == "1. red\n2. blue"
    assert markdown_safe("the blue triangle") == "the blue triangle"


def _loading_app():
    from keye.demo.app import build_app

    host = ModelHost("some/model", device="cpu")
    host.state = "loading"
    return build_app(host)


def test_no_page_load_event_holds_the_inputs_an_example_fills():
    """What an example fills must not be covered or held by the page's load events: no load event has the
    files or the question among its outputs (the deep link fills them through a State's change)."""
    app = _loading_app()
    config = app.get_config_file()
    labels = {c["id"]: (c.get("props") or {}).get("label") for c in config["components"]}
    inputs = {i for i, label in labels.items() if label in ("Video or images", "Question")}
    assert len(inputs) == 2, labels
    load_outputs = set()
    for dep in config["dependencies"]:
        if any(target[1] == "load" for target in dep["targets"]):
            load_outputs |= set(dep["outputs"])
    assert not load_outputs & inputs


def test_frame_captions_may_use_the_whole_thumbnail():
    from keye.demo.app import CSS

    app = _loading_app()
    gallery = [c for c in app.get_config_file()["components"] if c.get("type") == "gallery"]
    assert gallery and "keye-gallery" in (gallery[0]["props"].get("elem_classes") or [])
    rule = CSS[CSS.index(".keye-gallery .caption-label"):]
    rule = rule[: rule.index("}")]
    assert "white-space: normal" in rule and "max-width: calc(100% - 8px)" in rule


def test_the_loading_sheet_lets_clicks_through():
    """Gradio covers the page with a translucent "Loading..." sheet for about 1.5 s after it shows; clicks on
    an example must reach the table (tests/demo/test_app.py clicks one in a real browser)."""
    from keye.demo.app import CSS

    assert ".gradio-container > .main > .wrap.translucent {pointer-events: none}" in CSS


@pytest.mark.parametrize(("question", "radio", "mode"), [
    ("Which way does it move?", "auto", "auto"), ("Which way does it move?", "think", "think"),
    ("Which way does it move? /think", "auto", "think"), ("Which way does it move?/no_think", "think", "no_think"),
    ("hi", None, None), ("hi", "bogus", None),
])
def test_a_switch_typed_in_the_question_wins_over_the_radio(question, radio, mode):
    assert effective_mode(question, radio) == mode
