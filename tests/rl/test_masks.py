"""Response masks: prompt and padding excluded, first EOS included, nothing after it."""

from __future__ import annotations

import pytest
import torch

from keye.errors import KeyeInputError
from keye.rl.rollout.masks import response_lengths, response_mask

EOS, EOS2, PAD = 9, 8, 0


def test_mask_by_hand():
    prompt = torch.tensor([[PAD, 1, 2]] * 5)  # left-padded prompt columns never enter the mask
    responses = torch.tensor([
        [5, EOS, PAD, PAD],      # EOS at 1 -> [1, 1, 0, 0]
        [EOS, PAD, PAD, PAD],    # EOS first -> [1, 0, 0, 0]
        [5, 6, 7, 4],            # no EOS, cut at max_new_tokens -> all
        [PAD, 5, EOS2, PAD],     # a sampled pad id before the (second) EOS counts -> [1, 1, 1, 0]
        [5, 6, PAD, PAD],        # no EOS, right-padded when stacked -> [1, 1, 0, 0]
    ])
    seqs = torch.cat([prompt, responses], dim=1)
    mask = response_mask(seqs, 3, [EOS, EOS2], pad_id=PAD)
    expect = torch.tensor([
        [1, 1, 0, 0],
        [1, 0, 0, 0],
        [1, 1, 1, 1],
        [1, 1, 1, 0],
        [1, 1, 0, 0],
    ], dtype=torch.bool)
    assert torch.equal(mask, expect)
    # the prompt may be given as its attention mask
    assert torch.equal(response_mask(seqs, torch.ones(5, 3), [EOS, EOS2], pad_id=PAD), expect)
    # without pad_id a row without EOS is taken whole
    assert response_lengths(responses, [EOS, EOS2]).tolist() == [2, 1, 4, 3, 4]


def test_excluded_ids_inside_the_response():
    seqs = torch.tensor([[1, 2, 5, 77, 6, EOS]])
    mask = response_mask(seqs, 2, EOS, exclude_ids=[77])
    assert mask.tolist() == [[True, False, True, True]]


def test_mask_on_real_generate_output(tiny_model):
    ids = torch.tensor([[480, 480, 10, 11, 12], [20, 21, 22, 23, 24]])
    att = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    stops = list(range(0, 480, 4))
    seqs = tiny_model.generate(ids, att, max_new_tokens=8, do_sample=True, eos_token_id=stops, pad_token_id=480,
                               generator=torch.Generator().manual_seed(0))
    mask = response_mask(seqs, att, stops, pad_id=480)
    for row, m in zip(seqs[:, 5:].tolist(), mask.tolist()):
        first = next((i for i, t in enumerate(row) if t in stops), None)
        n = len(row) if first is None else first + 1
        assert m == [True] * n + [False] * (len(row) - n)
        assert all(t == 480 for t in row[n:])  # generate pads after the EOS


def test_bad_shapes():
    with pytest.raises(KeyeInputError):
        response_mask(torch.zeros(2, 3, dtype=torch.long), 4, EOS)
    with pytest.raises(KeyeInputError):
        response_lengths(torch.zeros(3, dtype=torch.long), EOS)
