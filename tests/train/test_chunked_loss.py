"""The chunked cross-entropy (keye.train.loss): values and gradients equal the full-logits loss.

References are computed here with ``F.cross_entropy`` over the full logits (the function), or by the model's own
full path (``KeyeVL.forward`` without a ``loss_request``, ``tree_loss(chunk_tokens=None)``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keye.errors import KeyeConfigError, KeyeInputError
from keye.model.keye_vl import shifted_targets
from keye.sft.config import SFTConfig
from keye.sft.trees import tree_loss
from keye.testing.model import make_tiny_model
from keye.train.config import load_config
from keye.train.lora import apply_lora
from keye.train.loss import LossRequest, chunked_cross_entropy
from keye.train.sections import LoraSection
from keye.train.tree import build_tree

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: one thread is fastest, and it keeps these tests quick when other jobs share the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _head_inputs(n=11, d=8, vocab=37, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, vocab, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=gen))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=gen))
    h = torch.randn(n, d, generator=gen).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[[1, 4, 5]] = -100
    weights = torch.randint(1, 4, (n,), generator=gen).float()
    return head, h, targets, weights


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def _close(got, want, msg=None):
    """float32 rounding: 1e-5 relative to the element or to the tensor's largest entry (sums over the vocabulary and
    over chunks are taken in another order than the full matmul's)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(want.abs().max())), msg=msg)


@pytest.mark.parametrize("chunk", [None, 1, 3, 4, 64])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias, weighted", [(False, False), (True, True)])
def test_function_equals_full_cross_entropy(chunk, smoothing, bias, weighted):
    head, h, targets, weights = _head_inputs(bias=bias)
    params = [h, *head.parameters()]
    w = weights if weighted else None
    loss, count = chunked_cross_entropy(h, targets, head, weights=w, label_smoothing=smoothing, chunk_size=chunk)
    per_row = F.cross_entropy(head(h).float(), targets, reduction="none", label_smoothing=smoothing)
    ref = (per_row * weights).sum() if weighted else per_row.sum()
    # the full path's own "sum" reduction, unweighted, is the same number
    if not weighted:
        torch.testing.assert_close(ref, F.cross_entropy(head(h), targets, reduction="sum", label_smoothing=smoothing))
    torch.testing.assert_close(loss, ref, **TOL)
    assert count == (float(weights[targets != -100].sum()) if weighted else int((targets != -100).sum()))
    for got, want in zip(_grads(2.5 * loss, params), _grads(2.5 * ref, params)):
        _close(got, want)


def test_rows_without_targets_give_zero_loss_and_gradients_that_reach_the_head():
    head, h, targets, _ = _head_inputs()
    for t, hid in ((torch.full_like(targets, -100), h), (targets[:0], h[:0])):
        loss, count = chunked_cross_entropy(hid, t, head, chunk_size=4)
        assert count == 0 and float(loss.detach()) == 0.0
        loss.backward()  # connected to the graph: every rank's backward reaches lm_head
        assert head.weight.grad is not None and not head.weight.grad.any()


def test_bf16_autocast_matches_the_full_path_under_autocast():
    head, h, targets, _ = _head_inputs(n=9, d=16, vocab=50)
    params = [h, head.weight]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = chunked_cross_entropy(h, targets, head, chunk_size=4)
        ref = F.cross_entropy(head(h).float(), targets, reduction="sum")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)  # the same bf16 logits
    for got, want in zip(_grads(loss, params), _grads(ref, params)):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_bad_arguments_are_refused():
    head, h, targets, _ = _head_inputs()
    with pytest.raises(KeyeInputError, match="chunk_size"):
        chunked_cross_entropy(h, targets, head, chunk_size=0)
    with pytest.raises(KeyeInputError, match="label_smoothing"):
        chunked_cross_entropy(h, targets, head, label_smoothing=1.0)
    with pytest.raises(KeyeInputError, match="token ids"):
        chunked_cross_entropy(h, targets.clamp(min=0) + 40, head)
    with pytest.raises(KeyeInputError, match="nn.Linear"):
        chunked_cross_entropy(h, targets, torch.nn.Sequential(head))
    with pytest.raises(KeyeConfigError, match="loss_chunk_tokens"):
        load_config(SFTConfig, None, ["train.loss_chunk_tokens=0"])
    with pytest.raises(KeyeConfigError, match="label_smoothing"):
        load_config(SFTConfig, None, ["train.label_smoothing=1.5"])
    cfg = load_config(SFTConfig, None, ["train.loss_chunk_tokens=null", "train.label_smoothing=0.1"])
    assert cfg.train.loss_chunk_tokens is None and cfg.train.label_smoothing == 0.1
    assert SFTConfig().train.loss_chunk_tokens is not None  # chunked by default


# ----------------------------------------------------------------------------------------- through KeyeVL
@pytest.fixture(scope="module")
def model():
    return make_tiny_model("1.5", seed=5).train()


def _packed_row(seed=0, lens=(6, 9, 5)):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 480, (1, sum(lens)), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt
    labels[0, lens[0] : lens[0] + 4] = -100  # the second sample's prompt
    return ids, labels, torch.tensor(lens)


def _loss_and_grads(model, **kw):
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, head_trained=True):
    (out_a, g_a), (out_b, g_b) = a, b
    torch.testing.assert_close(out_a.loss, out_b.loss, **TOL)
    assert out_a.num_target_tokens == out_b.num_target_tokens
    assert g_a.keys() == g_b.keys() and ("lm_head.weight" in g_a) == head_trained
    for name in g_b:
        _close(g_a[name], g_b[name], msg=name)


# chunks that divide the 12 targets (4), do not (7), all at once (None) and one chunk larger than the row (512)
@pytest.mark.parametrize("chunk, reduction", [(4, "sum"), (7, "mean"), (None, "sum"), (512, "mean")])
def test_packed_row_loss_and_gradients_equal_the_full_path(model, reduction, chunk):
    ids, labels, lens = _packed_row()
    kw = dict(input_ids=ids, labels=labels, seq_lens=lens, loss_reduction=reduction)
    full = _loss_and_grads(model, **kw)
    chunked = _loss_and_grads(model, loss_request=LossRequest(chunk), **kw)
    _assert_same(chunked, full)
    assert chunked[0].logits is None and full[0].logits is not None
    # no loss across sample boundaries: 20 tokens less the two prompts' 3 + 4, less the 3rd sample's first token
    # (the 2nd sample's first token is in its prompt)
    assert chunked[0].num_target_tokens == 20 - 3 - 4 - 1


def test_padded_batch_and_label_smoothing_equal_the_full_path(model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 480, (2, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    for smoothing in (0.0, 0.2):
        kw = dict(input_ids=ids, attention_mask=mask, labels=labels, label_smoothing=smoothing)
        _assert_same(_loss_and_grads(model, loss_request=LossRequest(3), **kw), _loss_and_grads(model, **kw))
    # logits_to_keep still gives the last positions' logits with a loss_request
    with torch.no_grad():
        a = model(input_ids=ids, labels=labels, loss_request=LossRequest(3), logits_to_keep=1)
        b = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(a.logits[:, -1], b.logits[:, -1])


def test_rows_without_target_tokens_through_the_model(model):
    ids, labels, lens = _packed_row(seed=2)
    labels = torch.full_like(labels, -100)
    chunked = _loss_and_grads(model, input_ids=ids, labels=labels, seq_lens=lens, loss_request=LossRequest(4))
    full = _loss_and_grads(model, input_ids=ids, labels=labels, seq_lens=lens)
    assert chunked[0].num_target_tokens == 0 and float(chunked[0].loss.detach()) == 0.0
    _assert_same(chunked, full)


def test_shifted_targets_mask_sample_boundaries():
    labels = torch.arange(10)[None]
    got = shifted_targets(labels, torch.tensor([0, 3, 7, 10], dtype=torch.int32))
    assert got.tolist() == [[1, 2, -100, 4, 5, 6, -100, 8, 9]]


def test_lora_on_the_llm_equal_the_full_path():
    lora = apply_lora(make_tiny_model("1.5", seed=6).train(), LoraSection(enabled=True, targets=["llm"], r=4))
    with torch.no_grad():  # peft starts B at zero: move it so the adapters' A matrices get gradients too
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ids, labels, lens = _packed_row(seed=3)
    kw = dict(input_ids=ids, labels=labels, seq_lens=lens, loss_reduction="sum")
    chunked, full = _loss_and_grads(lora, loss_request=LossRequest(5), **kw), _loss_and_grads(lora, **kw)
    # the LLM tower, lm_head included, is frozen under LoRA: the head gets no gradient and has no adapter
    _assert_same(chunked, full, head_trained=False)
    assert any("lora_A" in n for n in chunked[1]) and not any("lm_head" in n for n in chunked[1])


def test_tree_loss_chunked_equals_full(model):
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 480, (7,), generator=gen).tolist()
    answers = [torch.randint(0, 480, (k,), generator=gen).tolist() for k in (4, 6, 3)]
    answers[1][:2] = answers[0][:2]  # two answers share their first tokens: those targets count twice
    seqs = [prompt + a for a in answers]
    masks = [[False] * len(prompt) + [True] * len(a) for a in answers]
    other = torch.randint(0, 480, (9,), generator=gen).tolist()
    trees = [build_tree(model.config, seqs, masks), build_tree(model.config, [other], [[False] * 4 + [True] * 5])]
    mb = {"tree": trees, "num_samples": 2}
    cpu = torch.device("cpu")
    for smoothing in (0.0, 0.1):
        ref = _tree(model, mb, cpu, None, smoothing)
        for chunk in (3, 512):
            got = _tree(model, mb, cpu, chunk, smoothing)
            torch.testing.assert_close(got[0], ref[0], **TOL)
            assert got[1].keys() == ref[1].keys()
            for name in ref[1]:
                _close(got[1][name], ref[1][name], msg=name)


def _tree(model, mb, device, chunk, smoothing):
    model.zero_grad(set_to_none=True)
    loss = tree_loss(model, mb, device, chunk_tokens=chunk, label_smoothing=smoothing)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
