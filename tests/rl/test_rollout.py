"""Rollouts: prompt pieces survive split/collate, and the training forward sees the rollout's exact inputs."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.rollout.engines import LocalRollout, VLLMRollout
from keye.rl.rollout.samples import RLPrompt, collate_prompts, collate_samples, split_batch
from keye.rl.rollout.settings import SamplingSettings
from keye.train.logprobs import token_logprobs
from tests.rl.helpers import image

# a third of the ordinary vocabulary stops generation, so rows end at different lengths
STOP_IDS = list(range(0, 480, 3)) + [482]


def _prompts(video_path) -> list[RLPrompt]:
    vid = {"type": "video", "video": str(video_path), "nframes": 4, "resized_height": 56, "resized_width": 56}
    return [
        RLPrompt("img", [{"role": "user", "content": [{"type": "image", "image": image(1)},
                                                      {"type": "text", "text": "what is shown?"}]}], mode="think"),
        RLPrompt("txt", [{"role": "user", "content": "add 2 and 3"}], mode="no_think"),
        RLPrompt("vid", [{"role": "user", "content": [vid, {"type": "text", "text": "count the frames"}]}]),
        RLPrompt("img2", [{"role": "user", "content": [{"type": "image", "image": image(2, 84, 56)},
                                                       {"type": "image", "image": image(3)},
                                                       {"type": "text", "text": "compare"}]}], mode="auto"),
    ]


def test_split_then_collate_reproduces_the_processor_batch(rl_processor, rl_video):
    convs = [p.messages for p in _prompts(rl_video.path)]
    batch = rl_processor(convs, return_tensors="pt")
    pieces = split_batch(batch, rl_processor.image_token_id, rl_processor.video_token_id)
    assert [p.image_grid_thw.shape[0] if p.image_grid_thw is not None else 0 for p in pieces] == [1, 0, 0, 2]
    assert pieces[2].second_per_grid_ts is not None and pieces[0].pixel_values_videos is None
    again = collate_prompts(pieces, rl_processor.pad_token_id)
    assert set(again) == set(batch)
    for key, value in batch.items():
        assert torch.equal(again[key], value), key


class _Recorder:
    """Records the keyword inputs and the position ids of every forward call of a model."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        self.calls.append((dict(kwargs), output.position_ids.detach().clone()))

    def close(self):
        self.handle.remove()


def _check_training_forward_matches_rollout(model, processor, prompts):
    """Roll out, re-batch, run the training forward; returns (samples, batch, training log-probs)."""
    n = 2
    engine = LocalRollout(model, processor, SamplingSettings(max_new_tokens=6, temperature=0.9, max_batch_size=64), seed=3, eos_token_id=STOP_IDS)
    rec = _Recorder(model)
    samples = engine.generate(prompts, n)
    rec.close()
    assert [s.group for s in samples] == [i for i in range(len(prompts)) for _ in range(n)]
    assert [s.prompt.id for s in samples[::n]] == [p.id for p in prompts]
    lengths = [int(s.response_ids.numel()) for s in samples]
    assert len(set(lengths)) > 1, "test needs responses of different lengths"
    for s in samples:
        ends_in_stop = int(s.response_ids[-1]) in STOP_IDS
        assert s.finished == ends_in_stop
        assert not any(int(t) in STOP_IDS for t in s.response_ids[:-1])  # nothing after the first EOS

    prefill_kwargs, prefill_pos = rec.calls[0]
    decode_pos = [pos for _, pos in rec.calls[1:]]  # decode call j feeds response token j

    batch = collate_samples(samples, processor.pad_token_id)
    train = _Recorder(model)
    with torch.no_grad():
        out = token_logprobs(model, batch, batch["responses"], batch["response_attention"], temperature=0.9)
    train.close()
    (train_kwargs, train_pos), = train.calls

    # the same pixel rows, grids and video timing reach the training forward
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        a, b = train_kwargs.get(key), prefill_kwargs.get(key)
        assert (a is None) == (b is None), key
        if b is not None:
            assert torch.equal(a, b), key
    # ... and the same 3-D positions: prompt (attended slots) and every response token the rollout fed back
    prompt_len = prefill_pos.shape[2]
    att = batch["attention_mask"].bool()
    assert torch.equal(train_pos[:, :, :prompt_len][:, att], prefill_pos[:, att])
    checked = 0
    for b, k in enumerate(lengths):
        for j in range(min(k, len(decode_pos))):
            assert torch.equal(train_pos[:, b, prompt_len + j], decode_pos[j][:, b, 0]), (b, j)
            checked += 1
    assert checked >= sum(lengths) - len(lengths)
    # the log-probs of the one training forward equal those of the incremental KV-cache decoding
    for b, s in enumerate(samples):
        torch.testing.assert_close(out.logp[b, : lengths[b]], s.rollout_logp, atol=2e-4, rtol=1e-4)
        assert torch.all(out.logp[b, lengths[b] :] == 0)
    return samples, batch, out


def test_training_forward_sees_the_rollout_pixels_and_positions(tiny_model, rl_processor, rl_video):
    samples, batch, out = _check_training_forward_matches_rollout(tiny_model, rl_processor, _prompts(rl_video.path))
    assert "second_per_grid_ts" in batch and "pixel_values" in batch
    # the check has teeth: without the video timing the video rows' positions, hence log-probs, change
    broken = {k: v for k, v in batch.items() if k != "second_per_grid_ts"}
    with torch.no_grad():
        bad = token_logprobs(tiny_model, broken, batch["responses"], batch["response_attention"], temperature=0.9)
    vid_rows = [b for b, s in enumerate(samples) if s.prompt.id == "vid"]
    assert not torch.allclose(bad.logp[vid_rows], out.logp[vid_rows], atol=1e-3)


def test_keye_1_5_slow_fast_video_reaches_the_training_forward(tmp_path, rl_video):
    from keye.processing.processor import KeyeProcessor
    from keye.testing.model import make_tiny_model
    from keye.testing.processor import make_test_video, make_tiny_processor_dir

    processor = KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path / "p15", variant="1.5"))
    model = make_tiny_model("1.5", seed=1)
    static = make_test_video(tmp_path / "static.mp4", 12, fps=10.0, size=(56, 84), pattern="static")
    vid = {"type": "video", "video": str(static.path), "nframes": 4, "resized_height": 56, "resized_width": 56}
    prompts = _prompts(rl_video.path)[:2] + [
        RLPrompt("sf", [{"role": "user", "content": [vid, {"type": "text", "text": "what changes?"}]}], mode="think")]
    samples, batch, _ = _check_training_forward_matches_rollout(model, processor, prompts)
    assert batch["video_grid_thw"].shape[0] > 1  # slow and fast frames give several grid rows
    assert "second_per_grid_ts" not in batch


def test_chunked_and_full_logits_agree_with_gradients(tiny_model, rl_processor, rl_video):
    prompts = _prompts(rl_video.path)[:2]
    engine = LocalRollout(tiny_model, rl_processor, SamplingSettings(max_new_tokens=5), seed=1, eos_token_id=STOP_IDS)
    batch = collate_samples(engine.generate(prompts, 2), rl_processor.pad_token_id)
    tiny_model.train()
    grads = []
    for chunk in (3, None):
        tiny_model.zero_grad()
        out = token_logprobs(tiny_model, batch, batch["responses"], batch["response_attention"],
                             chunk_size=chunk, with_entropy=True)
        (out.logp.sum() + out.entropy.sum()).backward()
        grads.append((out.logp.detach(), out.entropy.detach(), tiny_model.lm_head.weight.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0][2], grads[1][2], atol=1e-5, rtol=1e-4)
    assert bool((grads[0][1][batch["response_attention"]] > 0).all())


def test_local_rollout_is_deterministic_per_seed(tiny_model, rl_processor, rl_video):
    prompts = _prompts(rl_video.path)[:2]

    def run(seed):
        eng = LocalRollout(tiny_model, rl_processor, SamplingSettings(max_new_tokens=5, max_batch_size=3), seed=seed)
        return [s.response_ids.tolist() for s in eng.generate(prompts, 3)]

    assert run(5) == run(5)
    assert run(5) != run(6)
    # exact resume: restoring the generator state replays the same random stream
    eng = LocalRollout(tiny_model, rl_processor, SamplingSettings(max_new_tokens=5), seed=9)
    eng.generate(prompts, 1)
    state = eng.state_dict()
    first = [s.response_ids.tolist() for s in eng.generate(prompts, 2)]
    fresh = LocalRollout(tiny_model, rl_processor, SamplingSettings(max_new_tokens=5), seed=0)
    fresh.load_state_dict(state)
    assert [s.response_ids.tolist() for s in fresh.generate(prompts, 2)] == first


def test_vllm_rollout_reports_missing_vllm(monkeypatch, rl_processor):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(KeyeConfigError, match="vllm"):
        VLLMRollout("some/model", rl_processor)


def test_sampled_placeholder_ids_are_scored_as_decoded(tiny_model, rl_processor):
    # a policy can sample <|image_pad|> (492) / <|video_pad|> (493); while decoding they are plain text tokens
    conv = [{"role": "user", "content": [{"type": "image", "image": image(5)}, {"type": "text", "text": "hi"}]}]
    batch = dict(rl_processor([conv, [{"role": "user", "content": "plain"}]], return_tensors="pt"))
    responses = torch.tensor([[5, 492, 7, 493, 482], [8, 9, 492, 482, 480]])
    resp_att = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    with torch.no_grad():
        out = token_logprobs(tiny_model, batch, responses, resp_att)
        # reference: prefill the prompt with the KV cache, then feed the response token by token
        from keye.model.text import KVCache

        cache = KVCache(len(tiny_model.model.layers))
        att = batch["attention_mask"]
        step = tiny_model(**batch, past_key_values=cache, use_cache=True)
        deltas = step.rope_deltas
        expect = []
        for j in range(responses.shape[1]):
            lp = torch.log_softmax(step.logits[:, -1].float(), -1).gather(1, responses[:, j : j + 1]).squeeze(1)
            expect.append(lp)
            att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
            step = tiny_model(responses[:, j : j + 1], attention_mask=att, past_key_values=cache, use_cache=True,
                              rope_deltas=deltas)
    expect = torch.stack(expect, 1) * resp_att
    torch.testing.assert_close(out.logp, expect, atol=2e-4, rtol=1e-4)


def test_vllm_rollout_weight_version_and_engine_state(monkeypatch, tiny_model, rl_processor):
    """``sync_weights`` pushes the trainer's tensors by name and sets the served version (default: one more
    than before); a checkpointed rollout state of the other engine kind is refused with a clear error
    (e.g. a run resumed with another ``rollout.engine``), not a KeyError."""
    import types

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))

    class _LLM:  # what sync_weights uses of vllm.LLM: apply_model(fn) runs fn on the worker's model
        def __init__(self):
            self.loaded: list[dict[str, torch.Tensor]] = []

        def apply_model(self, fn):
            return [fn(self)]

        def load_weights(self, items):
            self.loaded.append(dict(items))

    llm = _LLM()
    vllm_engine = VLLMRollout(llm, rl_processor, seed=5)
    assert vllm_engine.weight_version == 0 and vllm_engine.state_dict() == {"calls": 0}
    assert vllm_engine.sync_weights({"w": torch.ones(2)}) == 1 and vllm_engine.weight_version == 1
    vllm_engine.sync_weights({"w": torch.zeros(2)}, version=7)
    assert vllm_engine.weight_version == 7 and torch.equal(llm.loaded[-1]["w"], torch.zeros(2))
    local = LocalRollout(tiny_model, rl_processor, seed=1)
    with pytest.raises(KeyeConfigError, match="rollout.engine"):
        vllm_engine.load_state_dict(local.state_dict())
    with pytest.raises(KeyeConfigError, match="rollout.engine"):
        local.load_state_dict(vllm_engine.state_dict())
    vllm_engine.load_state_dict({"calls": 4})
    assert vllm_engine.state_dict() == {"calls": 4} and vllm_engine.weight_version == 7


def test_response_prefix_is_forced_and_trained(tiny_model, rl_processor, rl_video):
    """A forced response prefix leads every response (ids, text, rollout log-prob 0), and the tokens sampled after
    it are the model's continuation of prompt + prefix: the training forward over the whole response scores them
    exactly as the decoding did."""
    prefix = "<think>one"
    pre_ids = rl_processor.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    prompts = [dataclasses.replace(p, response_prefix=prefix) if i % 2 == 0 else p
               for i, p in enumerate(_prompts(rl_video.path))]
    engine = LocalRollout(tiny_model, rl_processor, SamplingSettings(max_new_tokens=5, temperature=0.9), seed=4, eos_token_id=STOP_IDS)
    samples = engine.generate(prompts, 2)
    k = len(pre_ids)
    for s in samples:
        forced = s.prompt.response_prefix is not None
        assert (s.response_ids[:k].tolist() == pre_ids) == forced
        assert s.text.startswith(rl_processor.decode(torch.tensor(pre_ids))) or not forced
        assert s.rollout_logp.shape == s.response_ids.shape
        if forced:
            assert torch.all(s.rollout_logp[:k] == 0) and 1 <= s.response_ids.numel() - k <= 5
    batch = collate_samples(samples, rl_processor.pad_token_id)
    with torch.no_grad():
        out = token_logprobs(tiny_model, batch, batch["responses"], batch["response_attention"], temperature=0.9)
    for b, s in enumerate(samples):
        start = k if s.prompt.response_prefix is not None else 0
        n = s.response_ids.numel()
        torch.testing.assert_close(out.logp[b, start:n], s.rollout_logp[start:], atol=2e-4, rtol=1e-4)
    bad = dataclasses.replace(prompts[1], response_prefix="")
    with pytest.raises(KeyeInputError, match="response_prefix"):
        engine.generate([bad], 1)
