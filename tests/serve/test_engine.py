"""The batching engine without HTTP: merging prompts, queue limits, failures, stop checks; the protocol
helpers (reasoning split, request validation)."""

from __future__ import annotations

import threading

import pytest
import torch

from keye.serve.engine import BatchEngine, EngineConfig, Job, merge_inputs
from keye.serve.errors import APIError
from keye.serve.protocol import ServerLimits, message_fields, parse_chat_request, split_reasoning


def test_merged_prompts_equal_the_processors_own_batch(tiny, media_dir):
    _, proc = tiny
    convs = [
        [{"role": "user", "content": [{"type": "video", "video": str(media_dir / "clip.mp4")},
                                      {"type": "text", "text": "what?"}]}],
        [{"role": "user", "content": [{"type": "image", "image": str(media_dir / "red.png")},
                                      {"type": "text", "text": "which colour is it?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": [{"type": "video", "video": str(media_dir / "clip.mp4")},
                                      {"type": "text", "text": "and now, after all that?"}]}],
    ]
    whole = proc(convs)
    merged = merge_inputs([dict(proc(c).items()) for c in convs], pad_token_id=proc.tokenizer.pad_token_id)
    assert set(merged) == set(whole.keys())
    for key in merged:
        torch.testing.assert_close(merged[key], whole[key], rtol=0, atol=0)


class FakeModel:
    """``generate_steps`` that emits scripted tokens per row; optionally blocks or fails."""

    def __init__(self, script: list[list[int]] | None = None, fail: bool = False):
        self.script = script
        self.fail = fail
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[dict] = []
        self.device = torch.device("cpu")

    def generate_steps(self, input_ids, attention_mask=None, *, max_new_tokens, **kw):
        self.calls.append({"rows": int(input_ids.shape[0]), "max_new_tokens": max_new_tokens, **kw})
        self.gate.wait(10)
        if self.fail:
            raise RuntimeError("device lost")
        for step in range(max_new_tokens):
            yield torch.tensor([row[min(step, len(row) - 1)] for row in self.script[: input_ids.shape[0]]]), None


def _job(events, n=1, max_tokens=5, seed=None, do_sample=False, stop_check=None, length=3):
    return Job(inputs={"input_ids": torch.ones(1, length, dtype=torch.long)}, n=n, max_tokens=max_tokens,
               do_sample=do_sample, temperature=1.0, top_p=1.0, seed=seed, emit=events.append, stop_check=stop_check)


def _wait_end(events, count=1, timeout=10):
    import time

    deadline = time.time() + timeout
    while sum(e["type"] in ("end", "error") for e in events) < count:
        assert time.time() < deadline, events
        time.sleep(0.01)


def test_eos_length_and_stop_check_end_choices():
    model = FakeModel(script=[[5, 6, 9], [7, 7, 7, 7, 7, 7], [8, 8, 8]])  # 9 is EOS
    engine = BatchEngine(model, eos_token_ids=[9], pad_token_id=0, config=EngineConfig(max_batch_size=4,
                                                                                       batch_window_ms=50))
    model.gate.clear()
    a, b = [], []
    engine.submit(_job(a, n=2, max_tokens=4, do_sample=True))  # sampled: one row per choice
    engine.submit(_job(b, do_sample=True, stop_check=lambda c, ids: len(ids) == 2))
    model.gate.set()
    _wait_end(a), _wait_end(b)
    engine.close()
    done_a = {e["choice"]: e for e in a if e["type"] == "done"}
    assert done_a[0]["reason"] == "stop" and done_a[0]["tokens"] == [5, 6] and done_a[0]["eos"] is True
    assert done_a[1]["reason"] == "length" and done_a[1]["tokens"] == [7, 7, 7, 7] and done_a[1]["eos"] is False
    done_b = [e for e in b if e["type"] == "done"]
    assert done_b[0]["reason"] == "stop" and done_b[0]["tokens"] == [8, 8] and done_b[0]["eos"] is False
    assert model.calls[0]["rows"] == 3  # both requests in one batch


def test_greedy_choices_are_decoded_once_and_all_get_the_answer():
    model = FakeModel(script=[[5, 6, 9]])
    engine = BatchEngine(model, eos_token_ids=[9], pad_token_id=0, config=EngineConfig(max_batch_size=2))
    events = []
    engine.submit(_job(events, n=3))  # 3 choices fit a batch of 2: greedy needs one row
    _wait_end(events)
    engine.close()
    assert [c["rows"] for c in model.calls] == [1]
    done = {e["choice"]: e for e in events if e["type"] == "done"}
    assert sorted(done) == [0, 1, 2]
    assert all(d["tokens"] == [5, 6] and d["reason"] == "stop" and d["eos"] for d in done.values())
    streamed = [[e["token"] for e in events if e["type"] == "token" and e["choice"] == c] for c in range(3)]
    assert streamed == [[5, 6]] * 3
    assert [e["type"] for e in events].count("end") == 1 and events[-1]["type"] == "end"


def test_seeded_and_differently_sampled_jobs_do_not_share_a_batch():
    model = FakeModel(script=[[1, 9]] * 8)
    engine = BatchEngine(model, eos_token_ids=[9], pad_token_id=0, config=EngineConfig(batch_window_ms=50))
    model.gate.clear()
    evs = [[] for _ in range(4)]
    engine.submit(_job(evs[0], do_sample=True, seed=3))
    engine.submit(_job(evs[1], do_sample=True, seed=3))
    engine.submit(_job(evs[2]))
    engine.submit(_job(evs[3]))
    model.gate.set()
    for e in evs:
        _wait_end(e)
    engine.close()
    assert sorted(c["rows"] for c in model.calls) == [1, 1, 2]


def test_full_queue_answers_429_and_recovers():
    model = FakeModel(script=[[1, 9]])
    engine = BatchEngine(model, eos_token_ids=[9], pad_token_id=0,
                         config=EngineConfig(max_batch_size=1, batch_window_ms=0, max_queue=2))
    model.gate.clear()
    first = []
    engine.submit(_job(first))  # taken by the engine thread, blocked in generate
    import time

    while not model.calls:
        time.sleep(0.01)
    waiting = [[], []]
    for w in waiting:
        engine.submit(_job(w))
    with pytest.raises(APIError) as info:
        engine.submit(_job([]))
    assert info.value.status == 429 and engine.stats["rejected"] == 1
    model.gate.set()
    for e in (first, *waiting):
        _wait_end(e)
    later = []
    engine.submit(_job(later))
    _wait_end(later)
    engine.close()
    assert [e["type"] for e in later][-1] == "end"


def test_a_failing_batch_reports_errors_and_the_engine_keeps_running():
    model = FakeModel(script=[[1, 9]], fail=True)
    engine = BatchEngine(model, eos_token_ids=[9], pad_token_id=0)
    bad = []
    engine.submit(_job(bad))
    _wait_end(bad)
    assert bad[-1]["type"] == "error" and bad[-1]["error"].status == 500
    model.fail = False
    good = []
    engine.submit(_job(good))
    _wait_end(good)
    engine.close()
    assert good[-1]["type"] == "end" and engine.stats["errors"] == 1


@pytest.mark.parametrize("text, final, reasoning, content", [
    ("plain answer", False, "", "plain answer"),
    ("<think>step 1</think>The answer is 4.", True, "step 1", "The answer is 4."),
    ("<analysis>easy</analysis><think>a</think><answer>B</answer>", True, "easya", "B"),
    ("<think>still thinking", False, "still thinking", ""),
    ("<think>done</think>ans <thi", False, "done", "ans "),  # a tag may be forming: held back
    ("value <3 and more", False, "", "value <3 and more"),  # a '<' that starts no tag is not held
])
def test_split_reasoning(text, final, reasoning, content):
    assert split_reasoning(text, final) == (reasoning, content)


def test_split_reasoning_grows_monotonically_over_prefixes():
    text = "<analysis>short question</analysis><think>1+1 is 2</think><answer>2</answer>"
    prev = ("", "")
    for k in range(len(text) + 1):
        r, c = split_reasoning(text[:k], final=False)
        assert r.startswith(prev[0]) and c.startswith(prev[1]), (k, r, c, prev)
        prev = (r, c)
    assert split_reasoning(text, final=True) == ("short question1+1 is 2", "2")


def test_message_fields_separates_reasoning():
    msg = message_fields("<think>count: 3</think><answer>3</answer>")
    assert msg == {"role": "assistant", "content": "3", "reasoning_content": "count: 3"}
    assert message_fields("3")["reasoning_content"] is None


def test_request_defaults_and_video_options():
    req = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://x/clip.mp4", "fps": 1, "max_frames": 8}},
        {"type": "text", "text": "q"}]}]}, ServerLimits(max_frames=16))
    assert req.max_tokens == ServerLimits().default_max_tokens and req.temperature == 1.0 and req.n == 1
    assert req.messages[0]["content"][0] == {"type": "video", "video": None, "fps": 1.0, "max_frames": 8}
    assert req.media[0].param == "messages[0].content[0].video_url.url"
    # The server's frame limit applies when the request names none.
    req2 = parse_chat_request({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://x/clip.mp4"}}]}]}, ServerLimits(max_frames=16))
    assert req2.messages[0]["content"][0]["max_frames"] == 16
