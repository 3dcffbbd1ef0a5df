"""Demo pieces that need no server: the loading state, the command line wiring."""

from __future__ import annotations

from keye.cli import build_parser
from keye.demo.app import make_respond
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
