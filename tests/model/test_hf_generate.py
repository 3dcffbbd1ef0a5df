"""``KeyeVL.generate`` is transformers' ``GenerationMixin.generate``: parity with ``Qwen3ForCausalLM`` on shared
weights, golden multimodal generation, and the generate arguments checked against independent computations."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

import keye
from keye.model.generation import apply_repetition_penalty
from keye.testing.model import make_tiny_model, qwen3_twin
from tests.model.test_golden import _kwargs

IMG, VS, VE, PAD = 492, 489, 490, 480


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("preview", seed=1)


@pytest.fixture(scope="module")
def qwen3(tiny):
    """transformers' Qwen3ForCausalLM holding the tiny model's decoder weights."""
    return qwen3_twin(tiny, bos_token_id=PAD, eos_token_id=482, pad_token_id=PAD)


@pytest.fixture(scope="module")
def tiny_pair():
    return keye.load_tiny()


def _padded_batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 480, (n,), generator=g) for n in lengths]
    L = max(lengths)
    ids = torch.full((len(rows), L), PAD)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    return ids, mask


def _pixels(grid, seed):
    t, h, w = grid
    return torch.rand(t * h * w, 3, 14, 14, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# ------------------------------------------------------------------------- parity with Qwen3ForCausalLM
@pytest.mark.parametrize("mode", ["greedy", "beam4", "sample"])
def test_text_generation_equals_qwen3_generate(tiny, qwen3, mode):
    ids, mask = _padded_batch([7, 12], seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=10, eos_token_id=[482], pad_token_id=PAD)
    if mode == "greedy":
        kw.update(do_sample=False)
    elif mode == "beam4":
        kw.update(do_sample=False, num_beams=4, num_return_sequences=2)
    else:
        kw.update(do_sample=True, temperature=0.9, top_k=40, top_p=0.95, num_return_sequences=2)
    outs = []
    for model in (qwen3, tiny):
        torch.manual_seed(1234)
        outs.append(model.generate(ids, **kw))
    assert outs[0].shape == outs[1].shape
    assert outs[1].tolist() == outs[0].tolist()


def test_beam_search_scores_equal_qwen3(tiny, qwen3):
    ids, mask = _padded_batch([9, 5], seed=8)
    kw = dict(attention_mask=mask, max_new_tokens=6, num_beams=4, do_sample=False, eos_token_id=[482],
              pad_token_id=PAD, return_dict_in_generate=True, output_scores=True)
    ref, got = qwen3.generate(ids, **kw), tiny.generate(ids, **kw)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert torch.allclose(got.sequences_scores, ref.sequences_scores, atol=1e-4)


# ------------------------------------------------------------------------------- golden multimodal
def test_golden_generation_through_transformers_generate(golden_preview_dir):
    import json

    cases = json.loads((golden_preview_dir / "cases.json").read_text())
    golden = {
        "inputs": load_file(str(golden_preview_dir / "inputs.safetensors")),
        "processor": load_file(str(golden_preview_dir / "processor.safetensors")),
    }
    exp = load_file(str(golden_preview_dir / "expected.safetensors"))
    model = keye.KeyeVL.from_pretrained(golden_preview_dir, torch_dtype="float32")
    case = cases["generation_case"]
    kw = _kwargs(case, golden)
    kw["attention_mask"] = torch.ones_like(kw["input_ids"])
    gk = case["generate_kwargs"]
    out = model.generate(**kw, **gk, return_dict_in_generate=True, output_logits=True)
    assert out.sequences.tolist() == exp["generate/sequences"].tolist()
    logits = torch.stack(out.logits, dim=1)
    assert (logits - exp["generate/step_logits"]).abs().max().item() <= 5e-5


def test_beams_and_return_sequences_keep_each_prompt_with_its_own_images(tiny):
    """Two prompts with different images, batched and left-padded, give what each gives alone: the packed
    pixels are repeated per prompt, not per pixel row."""
    prompts = [
        ([3, 4, 5, VS] + [IMG] * 6 + [VE, 7], (1, 4, 6), 0),
        ([9, VS] + [IMG] * 4 + [VE, 11, 12, 13, 14, 15], (1, 4, 4), 1),
    ]
    L = max(len(p) for p, _, _ in prompts)
    ids = torch.full((2, L), PAD)
    mask = torch.zeros(2, L, dtype=torch.long)
    for b, (p, _, _) in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    pix = torch.cat([_pixels(g, s) for _, g, s in prompts])
    grids = torch.tensor([g for _, g, _ in prompts])
    kw = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False, eos_token_id=[])
    batch = tiny.generate(ids, mask, pixel_values=pix, image_grid_thw=grids, **kw)
    assert batch.shape == (4, L + 5)
    for b, (p, g, s) in enumerate(prompts):
        alone = tiny.generate(torch.tensor([p]), pixel_values=_pixels(g, s), image_grid_thw=torch.tensor([g]), **kw)
        assert batch[2 * b: 2 * b + 2, L:].tolist() == alone[:, len(p):].tolist()


# ------------------------------------------------------------------------------- generate arguments
def _manual_greedy(model, ids, steps, banned=None, ban_until=0):
    """Greedy decoding by full forwards (no cache, no transformers): the independent reference."""
    seq = ids
    for i in range(steps):
        with torch.no_grad():
            logits = model(input_ids=seq).logits[:, -1].float()
        if banned is not None and i < ban_until:
            logits[:, banned] = float("-inf")
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


def test_min_new_tokens_suppresses_eos_until_reached(tiny):
    ids, _ = _padded_batch([10], seed=5)
    free = tiny.generate(ids, max_new_tokens=4, eos_token_id=[])
    eos = int(free[0, ids.shape[1] + 1])  # the token greedy decoding picks second
    stopped = tiny.generate(ids, max_new_tokens=6, eos_token_id=[eos])
    assert stopped.shape[1] == ids.shape[1] + 2  # sanity: without min_new_tokens it stops there
    out = tiny.generate(ids, max_new_tokens=6, eos_token_id=[eos], min_new_tokens=4)
    ref = _manual_greedy(tiny, ids, 6, banned=eos, ban_until=4)
    n = out.shape[1] - ids.shape[1]
    assert n >= 4 and eos not in out[0, ids.shape[1]: ids.shape[1] + 4].tolist()
    assert out[0].tolist() == ref[0, : out.shape[1]].tolist()
    if n < 6:  # it stopped early: on the first EOS after the minimum
        assert int(out[0, -1]) == eos


def test_return_dict_scores_and_logits_match_forward_passes(tiny):
    ids, _ = _padded_batch([11], seed=6)
    out = tiny.generate(ids, max_new_tokens=5, eos_token_id=[], repetition_penalty=1.3,
                        return_dict_in_generate=True, output_scores=True, output_logits=True)
    L = ids.shape[1]
    assert len(out.scores) == len(out.logits) == 5
    for i in range(5):
        prefix = out.sequences[:, : L + i]
        with torch.no_grad():
            full = tiny(input_ids=prefix).logits[:, -1].float()
        assert (out.logits[i] - full).abs().max() < 1e-5
        penalised = apply_repetition_penalty(full, prefix, 1.3)
        assert (out.scores[i] - penalised).abs().max() < 1e-5
        assert int(out.scores[i].argmax()) == int(out.sequences[0, L + i])


def test_num_return_sequences_equals_repeated_prompt_batch(tiny):
    ids, _ = _padded_batch([8], seed=7)
    kw = dict(max_new_tokens=6, eos_token_id=[], do_sample=True, temperature=1.3)
    torch.manual_seed(99)
    many = tiny.generate(ids, num_return_sequences=3, **kw)
    torch.manual_seed(99)
    repeated = tiny.generate(ids.repeat(3, 1), **kw)
    assert many.shape == (3, ids.shape[1] + 6)
    assert many.tolist() == repeated.tolist()
    assert len({tuple(r) for r in many[:, ids.shape[1]:].tolist()}) > 1


def test_no_repeat_ngram_and_repetition_penalty(tiny):
    ids = torch.tensor([[5, 6, 5, 6, 5, 6, 5, 6]])
    free = tiny.generate(ids, max_new_tokens=24, eos_token_id=[])
    out = tiny.generate(ids, max_new_tokens=24, eos_token_id=[], no_repeat_ngram_size=2)
    seq = out[0].tolist()
    bigrams = list(zip(seq[:-1], seq[1:]))
    new_bigrams = bigrams[ids.shape[1] - 1:]
    assert all(bigrams.index(bg) == ids.shape[1] - 1 + i for i, bg in enumerate(new_bigrams))
    assert free[0].tolist() != seq  # the prompt's repeated (5, 6) makes the plain greedy run differ
    pen = tiny.generate(ids, max_new_tokens=3, eos_token_id=[], repetition_penalty=2.0,
                        return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        logits = tiny(input_ids=ids).logits[:, -1].float()
    expected = int(apply_repetition_penalty(logits, ids, 2.0).argmax())
    assert int(pen.sequences[0, ids.shape[1]]) == expected


def test_custom_logits_processor_and_stopping_criteria(tiny):
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    ids, _ = _padded_batch([9], seed=11)
    first = int(tiny.generate(ids, max_new_tokens=1, eos_token_id=[])[0, -1])

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, first] = float("-inf")
            return scores

    class AfterThree(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 3, dtype=torch.bool)

    out = tiny.generate(ids, max_new_tokens=10, eos_token_id=[], logits_processor=LogitsProcessorList([Ban()]),
                        stopping_criteria=StoppingCriteriaList([AfterThree()]))
    ref = _manual_greedy(tiny, ids, 3, banned=first, ban_until=3)
    assert out.tolist() == ref.tolist()


def test_stop_strings_stop_at_the_first_occurrence(tiny_pair):
    model, processor = tiny_pair
    batch = processor([{"role": "user", "content": [{"type": "text", "text": "Tell me about the red ball."}]}])
    L = batch["input_ids"].shape[1]
    kw = dict(max_new_tokens=30, eos_token_id=[], do_sample=True, temperature=1.5)
    # A stop string that ends inside the generated text: the last two characters of some prefix's text
    # (the first seed whose free-running sample has a prefix ending in two letters; which seed that is
    # depends on the weights).
    for seed in range(7, 57):
        torch.manual_seed(seed)
        free = model.generate(**batch, **kw)[0, L:].tolist()
        texts = [processor.tokenizer.decode(free[:k]) for k in range(len(free) + 1)]
        k = next((k for k in range(3, len(free)) if texts[k][-2:].isalpha()), None)
        if k is not None:
            break
    assert k is not None, "no sample with a two-letter prefix ending in 50 seeds"
    stop = texts[k][-2:]
    expected = next(j for j in range(1, len(free) + 1) if stop in texts[j])
    torch.manual_seed(seed)  # stop criteria draw no random numbers: the same samples up to the stop
    out = model.generate(**batch, **kw, stop_strings=[stop], tokenizer=processor.tokenizer)[0, L:].tolist()
    assert expected < len(free) and out == free[:expected]


def test_text_iterator_streamer_receives_the_returned_text(tiny_pair):
    from transformers import TextIteratorStreamer

    model, processor = tiny_pair
    batch = processor([{"role": "user", "content": [{"type": "text", "text": "What color is the ball?"}]}])
    streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "ids", model.generate(**batch, max_new_tokens=16, do_sample=False, streamer=streamer)))
    worker.start()
    pieces = list(streamer)
    worker.join()
    new = result["ids"][0, batch["input_ids"].shape[1]:]
    assert len(pieces) > 1
    assert "".join(pieces) == processor.decode(new, skip_special_tokens=True)


def test_generator_is_reproducible_and_leaves_global_rng_alone(tiny):
    ids, _ = _padded_batch([6], seed=2)
    state = torch.get_rng_state()
    kw = dict(max_new_tokens=6, eos_token_id=[], do_sample=True, num_return_sequences=2)  # transformers path
    a = tiny.generate(ids, generator=torch.Generator().manual_seed(5), **kw)
    b = tiny.generate(ids, generator=torch.Generator().manual_seed(5), **kw)
    assert a.tolist() == b.tolist() and torch.equal(torch.get_rng_state(), state)
    # Keye's own fields only: Keye's loop, as before (same draws as generate_steps).
    own = tiny.generate(ids, generator=torch.Generator().manual_seed(5), max_new_tokens=6, eos_token_id=[],
                        do_sample=True)
    steps = [int(t[0]) for t, _ in tiny.generate_steps(ids, generator=torch.Generator().manual_seed(5),
                                                         max_new_tokens=6, eos_token_id=[], do_sample=True)]
    assert own[0, ids.shape[1]:].tolist() == steps
    with pytest.raises(ValueError, match="temperature"):
        tiny.generate(ids, do_sample=True, temperature=0.0)
