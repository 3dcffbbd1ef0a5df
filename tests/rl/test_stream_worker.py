"""The streaming rollout worker: behaviour log-probs equal a full forward of the weights that sampled each token,
whatever the batching (requests joining mid-decode, rows leaving, weights reloaded mid-answer, continued answers
with sampled placeholder ids); greedy answers equal plain KV-cache decoding; budgets, forced lengths, pause /
resume in the background thread."""

from __future__ import annotations

import time

import pytest
import torch

from keye.errors import KeyeInputError
from keye.rl.rollout.rollout_manager import Finished, TokenChunk
from keye.rl.rollout.samples import RLPrompt, RolloutSample, collate_samples, split_batch
from keye.rl.rollout.settings import SamplingSettings
from keye.rl.rollout.stream_worker import AnswerLengths, StreamWorker, WorkerFailed
from keye.rl.rollout.trajectory import Request
from keye.testing.model import make_tiny_model
from keye.train.logprobs import model_inputs, token_logprobs
from tests.rl.helpers import image

# a seventh of the ordinary vocabulary stops an answer, so answers end at different lengths
STOP_IDS = list(range(0, 480, 7))


def _messages(video_path) -> list[list[dict]]:
    vid = {"type": "video", "video": str(video_path), "nframes": 4, "resized_height": 56, "resized_width": 56}
    return [
        [{"role": "user", "content": [{"type": "image", "image": image(1)}, {"type": "text", "text": "what is it?"}]}],
        [{"role": "user", "content": "add 2 and 3"}],
        [{"role": "user", "content": [vid, {"type": "text", "text": "count the frames"}]}],
        [{"role": "user", "content": "a much longer question about the apples in every basket on the farm"}],
    ]


def _req(tid: int, messages, tokens=(), budget=None, attempt=1, sample=0) -> Request:
    return Request(tid, attempt, tid, sample, f"p{tid}", tuple(tokens), budget, {"messages": messages, "mode": None})


class _Answers:
    """Collects a worker's events and checks the protocol: a request's chunks come before its single Finished,
    nothing follows it, and versions never go back."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}
        self.logps: dict[int, list[float]] = {}
        self.versions: dict[int, list[int]] = {}
        self.done: dict[int, str] = {}

    def add(self, events) -> None:
        for ev in events:
            assert ev.traj_id not in self.done, f"event after the end of trajectory {ev.traj_id}"
            if isinstance(ev, TokenChunk):
                assert len(ev.token_ids) == len(ev.logps) > 0
                vs = self.versions.setdefault(ev.traj_id, [])
                assert not vs or vs[-1] <= ev.version
                self.tokens.setdefault(ev.traj_id, []).extend(ev.token_ids)
                self.logps.setdefault(ev.traj_id, []).extend(ev.logps)
                vs.extend([ev.version] * len(ev.token_ids))
            else:
                assert isinstance(ev, Finished)
                self.done[ev.traj_id] = ev.reason


def _full_logp(model, processor, messages, answer: list[int], temperature: float) -> torch.Tensor:
    """Log-probs of ``answer`` after the prompt from one training forward (keye.train.logprobs)."""
    inputs = split_batch(processor([messages], return_tensors="pt"), processor.image_token_id,
                         processor.video_token_id)[0]
    s = RolloutSample(prompt=RLPrompt("q", messages), group=0, inputs=inputs,
                      response_ids=torch.tensor(answer, dtype=torch.long), text="", finished=True)
    batch = collate_samples([s], processor.pad_token_id)
    with torch.no_grad():
        return token_logprobs(model, batch, batch["responses"], batch["response_attention"],
                              temperature=temperature).logp[0]


def test_log_probs_equal_a_full_forward_across_joins_and_weight_loads(rl_processor, rl_video):
    model = make_tiny_model("preview", seed=0)
    other = make_tiny_model("preview", seed=5)  # the "updated" weights
    models = {0: make_tiny_model("preview", seed=0), 1: other}
    msgs = _messages(rl_video.path)
    ph = rl_processor.image_token_id
    # a continuation whose kept tokens hold a sampled image placeholder id (decoded as text)
    cont = [302, ph, 303]
    temp = 0.7
    stops = STOP_IDS[::4]  # rarer stops: the first answers are still decoding when the others join
    w = StreamWorker(model, rl_processor, SamplingSettings(max_new_tokens=14, temperature=temp, max_batch_size=4), chunk_tokens=3, seed=1, eos_token_id=stops)
    got = _Answers()
    w.submit([_req(0, msgs[0]), _req(1, msgs[1])])
    got.add(w.poll())
    w.submit([_req(2, msgs[2]), _req(3, msgs[3]), _req(4, msgs[1], tokens=cont, budget=8)])  # joins; one waits
    got.add(w.poll())
    w.pause()
    assert w.poll() == []  # paused: nothing new
    w.load_weights([other.state_dict()], 1)
    w.resume()
    for _ in range(20):
        got.add(w.poll())
    assert sorted(got.done) == [0, 1, 2, 3, 4] and w.held() == 0
    # joins merged into a running batch, rows left (their cache columns trimmed), a weight reload
    assert w.counts["merges"] >= 1 and w.counts["trims"] >= 1 and w.counts["reprefilled_rows"] >= 1
    assert any(len(set(v)) == 2 for v in got.versions.values()), "no answer continued across the weight load"
    checked = 0
    for tid, toks in got.tokens.items():
        messages = msgs[1] if tid == 4 else msgs[tid]
        prefix = cont if tid == 4 else []
        for version, m in models.items():
            full = _full_logp(m, rl_processor, messages, prefix + toks, temp)[len(prefix):]
            mine = [j for j, v in enumerate(got.versions[tid]) if v == version]
            if mine:
                torch.testing.assert_close(torch.tensor(got.logps[tid])[mine], full[mine], atol=2e-4, rtol=1e-4)
                checked += len(mine)
        assert got.done[tid] == ("stop" if toks[-1] in stops else "length")
        assert not any(t in stops for t in toks[:-1])
    assert checked == sum(len(t) for t in got.tokens.values())
    assert len(got.tokens[4]) <= 8  # its budget
    # the check has teeth: the tokens sampled after the load are not explained by the old weights
    tid = next(t for t, v in got.versions.items() if 1 in v)
    new = [j for j, v in enumerate(got.versions[tid]) if v == 1]
    prefix = cont if tid == 4 else []
    old = _full_logp(models[0], rl_processor, msgs[1] if tid == 4 else msgs[tid], prefix + got.tokens[tid], temp)
    assert not torch.allclose(torch.tensor(got.logps[tid])[new], old[len(prefix):][new], atol=1e-3)


def _greedy(model, processor, messages, max_new: int) -> list[int]:
    batch = processor([messages], return_tensors="pt")
    out = []
    with torch.no_grad():
        for nxt, _ in model.generate_steps(batch["input_ids"], batch["attention_mask"], max_new_tokens=max_new,
                                           do_sample=False, eos_token_id=STOP_IDS,
                                           pad_token_id=processor.pad_token_id,
                                           **model_inputs(batch, model.device, model.dtype)):
            out.append(int(nxt[0]))
            if out[-1] in STOP_IDS:
                break
    return out


def test_greedy_answers_equal_plain_decoding_whatever_the_batching(rl_processor, rl_video):
    model = make_tiny_model("preview", seed=2)
    msgs = _messages(rl_video.path)
    want = {i: _greedy(model, rl_processor, m, 12) for i, m in enumerate(msgs)}
    assert len({len(v) for v in want.values()}) > 1, "test needs answers of different lengths"
    # top_k=1 samples the argmax: the answer no longer depends on random numbers, only on the computation
    w = StreamWorker(model, rl_processor, SamplingSettings(max_new_tokens=12, top_k=1), chunk_tokens=2, eos_token_id=STOP_IDS)
    got = _Answers()
    w.submit([_req(3, msgs[3])])
    got.add(w.poll())
    w.submit([_req(0, msgs[0]), _req(2, msgs[2])])
    got.add(w.poll())
    w.pause()
    w.load_weights([model.state_dict()], 1)  # same weights: the re-prefilled answers must go on unchanged
    w.resume()
    w.submit([_req(1, msgs[1])])
    for _ in range(12):
        got.add(w.poll())
    assert got.tokens == want
    assert all(lp == 0.0 for lps in got.logps.values() for lp in lps)


def test_budgets_continuations_and_bad_requests(rl_processor):
    model = make_tiny_model("preview", seed=0)
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    w = StreamWorker(model, rl_processor, SamplingSettings(max_new_tokens=6), chunk_tokens=4, eos_token_id=STOP_IDS)
    w.submit([_req(0, msgs, tokens=(400, STOP_IDS[3])),  # ended with an EOS before its worker died
              _req(1, msgs, tokens=(400,), budget=0),  # budget used up
              _req(2, msgs, budget=2), _req(3, msgs, tokens=(401, 402), budget=5)])
    got = _Answers()
    for _ in range(4):
        got.add(w.poll())
    assert got.done[0] == "stop" and got.done[1] == "length" and 0 not in got.tokens and 1 not in got.tokens
    assert len(got.tokens[2]) <= 2 and len(got.tokens[3]) <= 5
    with pytest.raises(KeyeInputError, match="has no 'messages'"):
        w.submit([Request(9, 1, 9, 0, "p9", (), None, {})])
    w.submit([_req(5, msgs, budget=3)])
    with pytest.raises(KeyeInputError, match="submitted twice"):
        w.submit([_req(5, msgs, budget=3)])


def test_forced_answer_lengths_are_exact_and_long_tailed(rl_processor):
    lengths = AnswerLengths(mu=1.5, sigma=1.0, max_tokens=16, seed=3)
    drawn = [lengths(f"q{i}", s) for i in range(200) for s in range(2)]
    assert drawn == [AnswerLengths(1.5, 1.0, 16, 3)(f"q{i}", s) for i in range(200) for s in range(2)]
    assert min(drawn) >= 1 and max(drawn) == 16 and sorted(drawn)[len(drawn) // 2] < 8  # median exp(1.5) ~ 4.5
    model = make_tiny_model("preview", seed=0)
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    w = StreamWorker(model, rl_processor, SamplingSettings(max_new_tokens=16), chunk_tokens=5, eos_token_id=STOP_IDS, answer_length=lengths)
    reqs = [Request(i, 1, i, i % 2, f"q{i // 2}", (), None, {"messages": msgs, "mode": None}) for i in range(8)]
    w.submit(reqs)
    got = _Answers()
    for _ in range(6):
        got.add(w.poll())
    for r in reqs:
        toks = got.tokens[r.traj_id]
        assert len(toks) == lengths(r.prompt_id, r.sample)
        assert not any(t in STOP_IDS for t in toks[:-1])  # EOS masked before the length
    # the mask has teeth: without it some answer samples a stop id before its forced length
    free = StreamWorker(model, rl_processor, SamplingSettings(max_new_tokens=16), chunk_tokens=16, eos_token_id=STOP_IDS)
    free.submit(reqs)
    ended = _Answers()
    ended.add(free.poll())
    assert any(ended.done[r.traj_id] == "stop" and len(ended.tokens[r.traj_id]) < lengths(r.prompt_id, r.sample)
               for r in reqs)


def test_background_thread_pauses_resumes_and_closes(rl_processor):
    model = make_tiny_model("preview", seed=0)
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    w = StreamWorker(model, rl_processor, SamplingSettings(max_new_tokens=40), chunk_tokens=1, background=True)
    got = _Answers()
    w.submit([_req(i, msgs) for i in range(3)])
    deadline = time.time() + 30
    while not got.tokens and time.time() < deadline:
        got.add(w.poll())
        time.sleep(0.01)
    w.pause()
    got.add(w.poll())
    frozen = {t: len(v) for t, v in got.tokens.items()}
    time.sleep(0.2)
    assert w.poll() == []  # nothing sampled while paused
    assert w.held() == 3 - len(got.done)
    w.resume()
    while len(got.done) < 3 and time.time() < deadline:
        got.add(w.poll())
        time.sleep(0.01)
    assert len(got.done) == 3 and all(len(got.tokens[t]) >= n for t, n in frozen.items())
    assert w.alive()
    w.close()
    assert not w.alive()
    with pytest.raises(WorkerFailed):
        w.poll()
