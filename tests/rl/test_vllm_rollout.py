"""The vLLM rollout path, against the recording stand-in ``tests/train/_fake_vllm.py`` (vLLM's objects and
signatures, run with a real tiny KeyeVL): the request of a text / image / video prompt carries everything the
learner sees (vLLM-side processing of it gives the learner's exact ids, pixels, grids and video timing, preview
and 1.5 slow-fast); the engine's reported log-probs equal the learner's on the same tokens; colocated sleep /
wake order; shard-by-shard weight sync (every tensor arrives, the version moves, both ways into the engine);
bad syncs name the tensor; versions per generation."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from keye import KeyeVL
from keye.errors import KeyeConfigError, KeyeInputError
from keye.processing.processor import KeyeProcessor
from keye.rl.rollout.engines import LocalRollout, VLLMRollout
from keye.rl.rollout.samples import RLPrompt, collate_samples
from keye.rl.rollout.settings import SamplingSettings
from keye.testing.model import save_tiny_checkpoint
from keye.testing.processor import make_test_video, make_tiny_processor_dir
from keye.train.logprobs import token_logprobs
from tests.rl.helpers import image
from tests.train import _fake_vllm

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, object]:
    """Tiny preview and 1.5 checkpoints (weights + processor files) and a static clip (1.5 fast frames)."""
    out = {}
    for variant in ("preview", "1.5"):
        d = tmp_path_factory.mktemp(f"vllm_{variant}")
        make_tiny_processor_dir(d, variant=variant)
        save_tiny_checkpoint(d, variant, seed=0)
        out[variant] = d
    out["static"] = make_test_video(tmp_path_factory.mktemp("vid") / "static.mp4", 12, fps=10.0, size=(56, 84),
                                    pattern="static")
    return out


@pytest.fixture()
def fake(monkeypatch):
    """The stand-in registered as ``vllm``; an in-process engine core unless a test says otherwise."""
    mod = _fake_vllm.reset()
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield mod
    _fake_vllm.reset()


def _prompts(video_path) -> list[RLPrompt]:
    vid = {"type": "video", "video": str(video_path), "nframes": 4}
    return [
        RLPrompt("txt", [{"role": "user", "content": "add 2 and 3"}], mode="no_think"),
        RLPrompt("img", [{"role": "user", "content": [{"type": "image", "image": image(1)},
                                                      {"type": "image", "image": image(2, 84, 56)},
                                                      {"type": "text", "text": "compare"}]}], mode="think"),
        RLPrompt("vid", [{"role": "user", "content": [vid, {"type": "text", "text": "what changes?"}]}]),
    ]


def _engine(path, **kw) -> tuple[VLLMRollout, object]:
    sampling = SamplingSettings(**{k: kw.pop(k) for k in ("max_new_tokens", "temperature", "top_p", "top_k") if k in kw})
    engine = VLLMRollout(str(path), KeyeProcessor.from_pretrained(path), sampling, **kw)
    return engine, _fake_vllm.LLM.instances[-1]


def _shards(state: dict[str, torch.Tensor], max_bytes: int):
    """``{name: tensor}`` shards of at most ``max_bytes`` (one tensor alone when it is larger), lazily."""
    shard, size = {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def _moved(path, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict with every tensor changed (a stand-in for an update)."""
    g = torch.Generator().manual_seed(seed)
    state = KeyeVL.from_pretrained(path, torch_dtype="float32").state_dict()
    return {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}


# ----------------------------------------------------------------------------------------------- requests
@pytest.mark.parametrize("variant", ["preview", "1.5"])
def test_requests_carry_exactly_what_the_learner_sees(fake, ckpts, rl_video, variant):
    video = rl_video.path if variant == "preview" else ckpts["static"].path
    prompts = _prompts(video)
    engine, llm = _engine(ckpts[variant], max_new_tokens=3)
    reqs = engine.requests(prompts)
    # text: the rendered chat template alone
    assert set(reqs[0]) == {"prompt"} and isinstance(reqs[0]["prompt"], str)
    # images: one placeholder each in the text, raw PIL images (vLLM's Keye parser takes no pixel tensors)
    assert set(reqs[1]) == {"prompt", "multi_modal_data"} and set(reqs[1]["multi_modal_data"]) == {"image"}
    assert reqs[1]["prompt"].count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert all(isinstance(im, Image.Image) for im in reqs[1]["multi_modal_data"]["image"])
    # video: uint8 frames [T, H, W, 3] and the processor kwargs of its variant, one entry per video
    frames = reqs[2]["multi_modal_data"]["video"]
    assert len(frames) == 1 and frames[0].dtype == np.uint8 and frames[0].ndim == 4 and frames[0].shape[-1] == 3
    assert reqs[2]["prompt"].count("<|video_pad|>") == 1
    kw = reqs[2]["mm_processor_kwargs"]
    if variant == "preview":
        assert set(kw) == {"fps"} and len(kw["fps"]) == 1
    else:
        assert set(kw) == {"frame_types", "timestamps", "height", "width", "fast_height", "fast_width"}
        types = kw["frame_types"][0]
        assert 0 < int(types.sum()) < len(types), "the static clip must give slow and fast frames"
        assert kw["timestamps"][0] is not None and len(kw["timestamps"][0]) == len(types)

    # vLLM-side processing of each request (the stand-in's Keye processor) gives the learner's exact inputs
    engine.generate(prompts, 1)
    inputs = engine.prepare(prompts)
    assert len(llm.requests) == len(prompts)
    for rec, pin in zip(llm.requests, inputs):
        assert rec["prompt_token_ids"] == pin.input_ids.tolist()
        for key in VISION_KEYS:
            ours = getattr(pin, key)
            assert (rec.get(key) is None) == (ours is None), key
            if ours is not None:
                assert torch.equal(rec[key], ours), key

    # the check has teeth: without the video kwargs the engine's prompt is not the learner's
    bare = {k: v for k, v in reqs[2].items() if k != "mm_processor_kwargs"}
    if variant == "preview":  # the HF processor's default fps gives other time positions
        llm.generate([bare], fake.SamplingParams(max_tokens=1))
        assert not torch.equal(llm.requests[-1]["second_per_grid_ts"], inputs[2].second_per_grid_ts)
    else:  # every frame slow, no timestamps: other tokens
        llm.generate([bare], fake.SamplingParams(max_tokens=1))
        assert llm.requests[-1]["prompt_token_ids"] != inputs[2].input_ids.tolist()


def test_engine_logprobs_equal_the_learners_on_the_same_tokens(fake, ckpts, rl_video):
    """The engine samples from its weights (the checkpoint); its ``processed_logprobs`` of every sampled token
    equal the learner's tempered log-probs on those tokens (fp32, CPU). vLLM's default ``raw_logprobs`` would
    be the untempered ones: that is why the rollout asks for processed log-probs."""
    fake.LLM.sampler = "model"
    path = ckpts["preview"]
    engine, llm = _engine(path, max_new_tokens=5, temperature=0.7, seed=11)
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and not llm.kwargs["enable_sleep_mode"]
    prompts = _prompts(rl_video.path)
    samples = engine.generate(prompts, 2)
    assert [s.group for s in samples] == [0, 0, 1, 1, 2, 2]
    for s in samples:
        assert s.rollout_logp is not None and s.rollout_logp.dtype == torch.float32
        assert s.rollout_logp.shape == s.response_ids.shape and s.response_ids.numel() >= 1
        assert s.finished == (int(s.response_ids[-1]) in llm.eos)
        assert s.text == engine.processor.decode(s.response_ids, skip_special_tokens=True)
        assert s.metadata["weight_version"] == 0
    assert len({tuple(s.response_ids.tolist()) for s in samples}) > 3  # prompts and children draw different streams

    batch = collate_samples(samples, engine.processor.pad_token_id)
    assert batch["has_rollout_logp"].all()
    model = KeyeVL.from_pretrained(path, torch_dtype="float32")
    att = batch["response_attention"]
    with torch.no_grad():
        tempered = token_logprobs(model, batch, batch["responses"], att, temperature=0.7).logp
        raw = token_logprobs(model, batch, batch["responses"], att).logp
    torch.testing.assert_close(batch["rollout_logp"][att], tempered[att], atol=2e-5, rtol=1e-5)
    assert torch.all(batch["rollout_logp"][~att] == 0)

    # the same engine left at vLLM's default mode reports log-probs under the untempered logits
    default = _fake_vllm.LLM(str(path))
    plain = VLLMRollout(default, engine.processor, SamplingSettings(max_new_tokens=5, temperature=0.7), seed=11)
    again = collate_samples(plain.generate(prompts, 2), engine.processor.pad_token_id)
    assert torch.equal(again["responses"], batch["responses"])  # same seeds, same weights: same tokens
    torch.testing.assert_close(again["rollout_logp"][att], raw[att], atol=2e-5, rtol=1e-5)
    assert (again["rollout_logp"][att] - tempered[att]).abs().max() > 1e-2


def test_local_rollout_records_the_filtered_distribution(ckpts, rl_video):
    """LocalRollout's rollout_logp is log p under the distribution it drew from: with top_k = 1 only the chosen
    token survives the filter, so every recorded log-prob is log 1 = 0, while the unfiltered one is not."""
    path = ckpts["preview"]
    model = KeyeVL.from_pretrained(path, torch_dtype="float32")
    proc = KeyeProcessor.from_pretrained(path)
    engine = LocalRollout(model, proc, SamplingSettings(max_new_tokens=4, temperature=0.8, top_k=1), seed=2)
    samples = engine.generate(_prompts(rl_video.path)[:2], 2)
    batch = collate_samples(samples, proc.pad_token_id)
    att = batch["response_attention"]
    assert torch.equal(batch["rollout_logp"][att], torch.zeros(int(att.sum())))
    with torch.no_grad():
        learner = token_logprobs(model, batch, batch["responses"], att, temperature=0.8).logp
    assert (learner[att] < -1e-3).all()


def test_collate_marks_rows_without_engine_logprobs(fake, ckpts):
    engine, _ = _engine(ckpts["preview"], max_new_tokens=3)
    samples = engine.generate(_prompts("unused")[:1], 3)
    samples[1].rollout_logp = None  # an engine that did not score this one
    samples[2].source = "replay"  # replayed text: never the engine's log-probs
    batch = collate_samples(samples, engine.processor.pad_token_id)
    assert batch["has_rollout_logp"].tolist() == [True, False, False]
    assert torch.all(batch["rollout_logp"][1:] == 0)
    k = samples[0].response_ids.numel()
    assert torch.equal(batch["rollout_logp"][0, :k], samples[0].rollout_logp)
    samples[0].rollout_logp = samples[0].rollout_logp[:-1]
    with pytest.raises(KeyeInputError, match="rollout_logp has"):
        collate_samples(samples, engine.processor.pad_token_id)


# ------------------------------------------------------------------------------------------ sleep / wake
def test_colocated_engine_sleeps_after_generate_and_wakes_weights_before_the_kv_cache(fake, ckpts):
    path = ckpts["preview"]
    engine, llm = _engine(path, max_new_tokens=3, colocate=True)
    assert llm.kwargs["enable_sleep_mode"] is True
    prompts = _prompts("unused")[:1]
    engine.generate(prompts, 2)
    assert llm.sleeping == {"weights", "kv_cache"}  # the learner gets the GPU back
    n = engine.sync_weights(_shards(_moved(path, 1), 4096), version=1)
    assert llm.sleeping == {"kv_cache"}  # weights loaded, the KV cache not re-allocated yet
    engine.generate(prompts, 2)
    loads = len(llm.weight_loads)
    assert sum(len(w["names"]) for w in llm.weight_loads) == n and loads > 1
    assert llm.calls == ([("generate", 1), ("sleep", 1), ("wake_up", ("weights",))] + [("load_weights", len(w["names"]))
                                                                                     for w in llm.weight_loads]
                         + [("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate", 1), ("sleep", 1)])


def test_sleep_level_two_needs_a_sync_and_old_wake_up_wakes_everything(fake, ckpts):
    path = ckpts["preview"]
    engine, llm = _engine(path, max_new_tokens=3, colocate=True, sleep_level=2)
    prompts = _prompts("unused")[:1]
    engine.generate(prompts, 1)
    with pytest.raises(KeyeConfigError, match="level-2 sleep"):
        engine.generate(prompts, 1)
    engine.sync_weights(_moved(path, 2), version=5)
    assert engine.generate(prompts, 1)[0].metadata["weight_version"] == 5

    class OldLLM(_fake_vllm.LLM):  # vLLM before tagged wake-up
        def wake_up(self) -> None:
            super().wake_up(None)

    old = VLLMRollout(OldLLM(str(path), enable_sleep_mode=True), engine.processor, SamplingSettings(max_new_tokens=3), colocate=True)
    old.generate(prompts, 1)
    old.sync_weights(_moved(path, 3))
    assert old.llm.calls[2] == ("wake_up", None) and not old.llm.sleeping


# ------------------------------------------------------------------------------------------------- sync
@pytest.mark.parametrize("in_process", [True, False])
def test_sync_in_shards_reassembles_the_state_dict_and_sets_the_version(fake, ckpts, monkeypatch, in_process):
    """An iterator of bounded shards (the learner's export) arrives tensor for tensor, one load call per shard,
    through the in-process model (verl's path) or ``LLM.apply_model`` (a pickled function, multi-process V1);
    the generations after it sample the new weights and record its version."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else "1")
    path = ckpts["preview"]
    engine, llm = _engine(path, max_new_tokens=3)
    assert (llm.llm_engine.model_executor is not None) == in_process
    prompts = _prompts("unused")[:2]
    engine.generate(prompts, 1)
    new = _moved(path, 4)
    shards = list(_shards(new, 8192))
    assert len(shards) > 2
    assert engine.sync_weights(iter(shards), version=3) == len(new)
    assert engine.weight_version == 3
    held = llm.weights
    assert held.keys() == new.keys() and all(torch.equal(held[k], new[k]) for k in new)
    assert [w["names"] for w in llm.weight_loads] == [list(s) for s in shards]
    assert {w["via"] for w in llm.weight_loads} == {"direct" if in_process else "apply_model"}
    samples = engine.generate(prompts, 1)
    assert llm.generations[-1]["weights"] == _fake_vllm.fingerprint(new)
    assert {s.metadata["weight_version"] for s in samples} == {3}

    # (name, tensor) pairs, then a plain state dict; without a version the version moves by one
    newer = _moved(path, 5)
    engine.sync_weights(iter(newer.items()))
    assert engine.weight_version == 4 and all(torch.equal(llm.weights[k], newer[k]) for k in newer)
    engine.sync_weights(new)
    assert engine.weight_version == 5 and all(torch.equal(llm.weights[k], new[k]) for k in new)
    assert [s.metadata["weight_version"] for s in engine.generate(prompts, 1)] == [5, 5]
    assert len(llm.generations) == 3 and llm.calls.count(("reset_prefix_cache",)) == 2


def test_a_bad_sync_names_the_tensor_and_a_partial_one_blocks_generation(fake, ckpts):
    path = ckpts["preview"]
    engine, llm = _engine(path, max_new_tokens=3)
    good = _moved(path, 6)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(KeyeInputError, match="'model.layers.0.mlp.up_prj.weight'.*not a weight"):
        engine.sync_weights({"model.layers.0.mlp.up_prj.weight": good[name]})
    with pytest.raises(KeyeInputError, match=rf"'{name}'.*has shape \(3, 4\)"):
        engine.sync_weights({name: torch.zeros(3, 4)})
    with pytest.raises(KeyeInputError, match="item 0 is a str"):
        engine.sync_weights(["model.norm.weight"])
    assert llm.weight_loads == [] and engine.weight_version == 0  # refused before anything reached the engine
    engine.generate(_prompts("unused")[:1], 1)  # ... so the engine still serves version 0

    shards = list(_shards(good, 8192))
    with pytest.raises(KeyeInputError, match=f"'{name}'.*sent twice"):
        engine.sync_weights([*shards, {name: good[name]}], version=1)
    with pytest.raises(KeyeConfigError, match="partial weight update"):
        engine.generate(_prompts("unused")[:1], 1)
    with pytest.raises(KeyeInputError, match="never sent"):
        engine.sync_weights(shards[:-1], version=1)
    engine.sync_weights(iter(shards), version=1)
    assert engine.generate(_prompts("unused")[:1], 1)[0].metadata["weight_version"] == 1

    # without known shapes the engine's own loader refuses, and the error still names the tensor
    engine.param_shapes = None
    with pytest.raises(KeyeInputError, match="There is no module or parameter named 'lm_head.wieght'"):
        engine.sync_weights({"lm_head.wieght": good["lm_head.weight"]})


def test_response_prefix_continues_the_engine_prompt(fake, ckpts, rl_video):
    """A forced response prefix is appended to the engine's prompt and leads the sample: its ids, its text, and
    rollout log-prob 0 (chosen by the caller); the learner scores the sampled continuation as the engine did."""
    fake.LLM.sampler = "model"
    path = ckpts["preview"]
    engine, llm = _engine(path, max_new_tokens=4, temperature=0.7, seed=5)
    prefix = "<think>"
    pre = engine.processor.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    prompts = [dataclasses.replace(p, response_prefix=prefix) for p in _prompts(rl_video.path)[:2]]
    samples = engine.generate(prompts, 2)
    for s in samples:
        assert s.response_ids[: len(pre)].tolist() == pre and s.text.startswith(prefix)
        assert torch.all(s.rollout_logp[: len(pre)] == 0) and s.rollout_logp.shape == s.response_ids.shape
    assert llm.requests[-1]["prompt_token_ids"][-len(pre):] == pre  # decoding continued after the prefix
    batch = collate_samples(samples, engine.processor.pad_token_id)
    model = KeyeVL.from_pretrained(path, torch_dtype="float32")
    att = batch["response_attention"].clone()
    att[:, : len(pre)] = False  # the forced tokens were not sampled
    with torch.no_grad():
        learner = token_logprobs(model, batch, batch["responses"], batch["response_attention"], temperature=0.7).logp
    torch.testing.assert_close(batch["rollout_logp"][att], learner[att], atol=2e-5, rtol=1e-5)
