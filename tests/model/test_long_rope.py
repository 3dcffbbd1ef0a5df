"""Long context from the checkpoint: the text RoPE base and the maximum positions come from config.json (Keye-VL-1.5:
128K positions, rope_theta 8e6), and positions far past 32K are rotated by the reference formula, uncapped."""

from __future__ import annotations

import pytest
import torch

from keye import KeyeVL
from keye.config import KeyeVLConfig, tiny_config
from keye.errors import KeyeConfigError
from keye.testing.model import init_unit_scale, qwen3_twin

BASE, MAX_POS = 8_000_000.0, 131072


def _long_config_dict(nested: bool) -> dict:
    """A tiny 1.5 config.json with Keye-VL-1.5's long-context numbers; ``nested``: the base only inside
    ``rope_parameters`` (as transformers 5 writes it), else at the top level (as the official files do)."""
    d = tiny_config("1.5").to_dict()
    d["max_position_embeddings"] = MAX_POS
    if nested:
        del d["rope_theta"]
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": BASE, "mrope_section": d["rope_scaling"]["mrope_section"]}
    else:
        d["rope_theta"] = BASE
    return d


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return init_unit_scale(KeyeVL(KeyeVLConfig.from_dict(_long_config_dict(nested=True))), seed=0).eval()


@pytest.mark.parametrize("nested", [False, True])
def test_base_and_max_positions_are_read_from_the_file(nested):
    cfg = KeyeVLConfig.from_dict(_long_config_dict(nested))
    assert cfg.text.rope_theta == BASE and cfg.text.max_position_embeddings == MAX_POS
    again = KeyeVLConfig.from_dict(cfg.to_dict())
    assert again.text.rope_theta == BASE and again.text.max_position_embeddings == MAX_POS


def test_unimplemented_or_conflicting_rope_settings_are_refused():
    d = _long_config_dict(nested=False)
    d["rope_scaling"] = {"type": "yarn", "factor": 4.0, "mrope_section": [2, 3, 3]}
    with pytest.raises(KeyeConfigError, match="yarn"):
        KeyeVLConfig.from_dict(d)
    d = _long_config_dict(nested=True)
    d["rope_theta"] = 1e6
    with pytest.raises(KeyeConfigError, match="two RoPE bases"):
        KeyeVLConfig.from_dict(d)


def _reference_cos_sin(positions: torch.Tensor, head_dim: int, base: float, sections: list[int]):
    """cos / sin [L, head_dim] of 3-D positions [3, L]: inv_freq_i = 1 / base^(2i / d); frequency i takes the
    t axis for its first ``sections[0]`` entries, h for the next ``sections[1]``, w for the rest; the half-table
    is repeated for rotate-half. Angles in float32, as the reference implementation (Qwen2-VL) computes them."""
    half = head_dim // 2
    exact = torch.tensor([1.0 / base ** (2 * i / head_dim) for i in range(half)], dtype=torch.float64)
    # float32 exponents and power, as the reference computes inv_freq (an angle near 1e5 rad moves by ~1e-3 with
    # one float32 ulp of a frequency, so the precision is part of the formula)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    torch.testing.assert_close(inv_freq.double(), exact, rtol=1e-6, atol=0)
    axis = [0] * sections[0] + [1] * sections[1] + [2] * sections[2]
    assert len(axis) == half
    pos = positions[axis, :].T.to(torch.float32)  # [L, half]: each frequency's own axis
    angle = pos * inv_freq[None, :]
    table = torch.cat([angle, angle], dim=-1)
    return table.cos(), table.sin()


def test_positions_past_32k_use_the_reference_rope(model):
    cfg = model.config.text
    n = 6
    steps = torch.arange(n)
    # three different axes far past 32K (and past the preview's 40,960): the sections must pick the right one
    positions = torch.stack([40_000 + steps, 70_001 + 2 * steps, MAX_POS - 1 - 3 * (n - 1) + 3 * steps])
    seen = {}

    def grab(module, args):
        seen["cos"], seen["sin"] = args[1], args[2]

    hook = model.model.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 480, (1, n)), position_ids=positions[:, None, :])
    finally:
        hook.remove()
    cos, sin = _reference_cos_sin(positions, cfg.head_dim, BASE, list(cfg.mrope_section))
    assert seen["cos"].shape == (1, n, cfg.head_dim)
    torch.testing.assert_close(seen["cos"][0], cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen["sin"][0], sin, rtol=0, atol=1e-6)
    # the test tells the bases apart: the preview's 1e6 gives other angles at these positions
    wrong, _ = _reference_cos_sin(positions, cfg.head_dim, 1e6, list(cfg.mrope_section))
    assert (seen["cos"][0] - wrong).abs().max() > 0.1


def test_text_logits_past_32k_equal_transformers_qwen3(model):
    """A text row at positions 50,000+ (all three axes equal): the same logits as transformers' Qwen3 with the
    same base, an implementation of the formula independent of keye's."""
    hf = qwen3_twin(model)
    assert hf.config.rope_parameters["rope_theta"] == BASE
    ids = torch.randint(0, 480, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = 50_000 + torch.arange(12)[None]
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        got = model(input_ids=ids, position_ids=pos[None].expand(3, -1, -1)).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_rope_index_of_a_text_row_longer_than_32k_is_not_capped(model):
    n = 33_000
    positions, deltas = model.get_rope_index(torch.full((1, n), 7))
    assert positions.shape == (3, 1, n)
    assert torch.equal(positions[:, 0], torch.arange(n).expand(3, -1)) and int(deltas) == 0
