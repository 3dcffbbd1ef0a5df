"""Model properties: reference parity with transformers, packing, padding, caching, round trips, 1.5."""

from __future__ import annotations

import json

import pytest
import torch

from keye import KeyeVL
from keye.config import KeyeVLConfig, tiny_config
from keye.errors import KeyeConfigError, KeyeInputError, KeyeWeightsError
from keye.testing.model import init_unit_scale, make_tiny_model, qwen3_twin

IMG, VID, VS, VE = 492, 493, 489, 490


def _pixels(grid, seed):
    t, h, w = grid
    g = torch.Generator().manual_seed(seed)
    return torch.rand(t * h * w, 3, 14, 14, generator=g) * 2 - 1


def _prompt(pieces, seed=0):
    """Token ids from pieces: int n -> n random text ids; ('img'|'vid', n_tokens) -> a vision block."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for p in pieces:
        if isinstance(p, int):
            ids += torch.randint(0, 480, (p,), generator=g).tolist()
        else:
            kind, n = p
            ids += [VS] + [IMG if kind == "img" else VID] * n + [VE]
    return torch.tensor([ids])


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("preview", seed=1)


@pytest.fixture(scope="module")
def tiny15():
    return make_tiny_model("1.5", seed=2)


# ------------------------------------------------------------------------------ reference parity
def test_text_logits_equal_transformers_qwen3(tiny):
    hf = qwen3_twin(tiny)  # checks that every decoder tensor maps onto Qwen3's
    ids = _prompt([40], seed=3)
    mask = torch.ones_like(ids)
    mask_padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), mask], 1)
    ids_padded = torch.cat([torch.full((1, 5), 480), ids], 1)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = tiny(input_ids=ids).logits
        got_pad = tiny(input_ids=ids_padded, attention_mask=mask_padded).logits[:, 5:]
    assert (got - ref).abs().max() < 2e-5
    assert (got_pad - ref).abs().max() < 2e-5


def test_tower_without_rope_equals_transformers_siglip(tiny):
    """Where the designs coincide (one square image whose patch grid equals the position table, no
    2-D RoPE, no packing) our tower is the stock SigLIP vision encoder + post_layernorm."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    v = tiny.config.vision
    hf = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=v.num_hidden_layers,
        num_attention_heads=v.num_attention_heads, image_size=v.image_size, patch_size=v.patch_size,
        hidden_act=v.hidden_act, layer_norm_eps=v.layer_norm_eps,
    )).eval()
    prefix = "visual.vision_model."
    ours = {k.removeprefix(prefix): val for k, val in tiny.state_dict().items() if k.startswith(prefix)}
    target = getattr(hf, "vision_model", hf)  # transformers 5 flattened the wrapper
    missing, unexpected = target.load_state_dict(ours, strict=False)
    assert not unexpected and all(k.startswith("head.") or "position_ids" in k for k in missing)
    s = v.num_positions_side
    image = torch.rand(1, 3, s * 14, s * 14) * 2 - 1
    patches = image.view(3, s, 14, s, 14).permute(1, 3, 0, 2, 4).reshape(s * s, 3, 14, 14)
    with torch.no_grad():
        ref = hf(pixel_values=image).last_hidden_state[0]
        got = tiny.visual(patches, [(1, s, s)], use_rope=False)
        with_rope = tiny.visual(patches, [(1, s, s)])
    assert (got - ref).abs().max() < 2e-5
    assert (with_rope - ref).abs().max() > 1e-2  # the 2-D RoPE really changes the tower


# -------------------------------------------------------------------------------- properties
def test_packed_multi_image_equals_per_image(tiny):
    grids = [(1, 4, 6), (1, 8, 2), (1, 2, 2)]
    pix = [_pixels(g, i) for i, g in enumerate(grids)]
    with torch.no_grad():
        packed = tiny.encode_vision(torch.cat(pix), torch.tensor(grids))
        alone = torch.cat([tiny.encode_vision(p, torch.tensor([g])) for p, g in zip(pix, grids)])
    assert (packed - alone).abs().max() < 1e-5


def test_eager_equals_sdpa(tiny):
    ids = _prompt([5, ("img", 6), 7])
    kw = dict(input_ids=ids, pixel_values=_pixels((1, 4, 6), 0), image_grid_thw=torch.tensor([[1, 4, 6]]))
    with torch.no_grad():
        a = tiny(**kw).logits
        tiny.set_attn_implementation("eager")
        b = tiny(**kw).logits
        tiny.set_attn_implementation("sdpa")
    assert (a - b).abs().max() < 1e-5


def test_flash_attention_backend_error_is_clear():
    from keye.model.attention import flash_attn_available

    if flash_attn_available():  # pragma: no cover - only on a GPU machine with flash-attn
        return
    with pytest.raises(KeyeConfigError, match="flash-attn"):
        make_tiny_model(attn_implementation="flash_attention_2")


def test_left_padded_batch_equals_rows_alone(tiny):
    rows = [_prompt([3, ("img", 6), 4], seed=1)[0], _prompt([9, ("img", 4), 2, ("vid", 12), 6], seed=2)[0]]
    grids_img = [(1, 4, 6), (1, 4, 4)]
    pix = [_pixels(grids_img[0], 0), _pixels(grids_img[1], 1)]
    vid_grid, vid_pix = (3, 4, 4), _pixels((3, 4, 4), 2)
    L = max(len(r) for r in rows)
    ids = torch.full((2, L), 480)
    mask = torch.zeros(2, L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    with torch.no_grad():
        batch = tiny(input_ids=ids, attention_mask=mask, pixel_values=torch.cat(pix),
                     image_grid_thw=torch.tensor(grids_img), pixel_values_videos=vid_pix,
                     video_grid_thw=torch.tensor([vid_grid]), second_per_grid_ts=torch.tensor([0.5]))
        r0 = tiny(input_ids=rows[0][None], pixel_values=pix[0], image_grid_thw=torch.tensor([grids_img[0]]))
        r1 = tiny(input_ids=rows[1][None], pixel_values=pix[1], image_grid_thw=torch.tensor([grids_img[1]]),
                  pixel_values_videos=vid_pix, video_grid_thw=torch.tensor([vid_grid]),
                  second_per_grid_ts=torch.tensor([0.5]))
    assert (batch.logits[0, L - len(rows[0]):] - r0.logits[0]).abs().max() < 1e-5
    assert (batch.logits[1] - r1.logits[0]).abs().max() < 1e-5
    valid0 = mask[0].bool()
    assert batch.position_ids[:, 0, valid0].tolist() == r0.position_ids[:, 0].tolist()


def test_cached_decoding_equals_full_forward(tiny):
    ids = _prompt([4, ("img", 6), 5], seed=7)
    vis = dict(pixel_values=_pixels((1, 4, 6), 3), image_grid_thw=torch.tensor([[1, 4, 6]]))
    seqs, step_logits = tiny.generate(ids, **vis, max_new_tokens=6, eos_token_id=[], return_step_logits=True)
    assert seqs.shape == (1, ids.shape[1] + 6)
    for i in range(6):
        prefix = seqs[:, : ids.shape[1] + i]
        with torch.no_grad():
            full = tiny(input_ids=prefix, **vis).logits[0, -1]
        assert (full - step_logits[0, i]).abs().max() < 1e-5
        assert int(full.argmax()) == int(seqs[0, ids.shape[1] + i])


def test_batched_generation_equals_single(tiny):
    rows = [_prompt([6], seed=11)[0], _prompt([14], seed=12)[0]]
    L = max(len(r) for r in rows)
    ids = torch.full((2, L), 480)
    mask = torch.zeros(2, L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = r
        mask[b, L - len(r):] = 1
    batch = tiny.generate(ids, mask, max_new_tokens=5, eos_token_id=[])
    for b, r in enumerate(rows):
        alone = tiny.generate(r[None], max_new_tokens=5, eos_token_id=[])
        assert batch[b, L:].tolist() == alone[0, len(r):].tolist()


def test_generation_stops_on_any_eos_and_pads(tiny):
    ids = _prompt([8], seed=5)
    free = tiny.generate(ids, max_new_tokens=6, eos_token_id=[])
    first, second = int(free[0, ids.shape[1]]), int(free[0, ids.shape[1] + 1])
    out = tiny.generate(ids, max_new_tokens=6, eos_token_id=[999, first])
    assert out.shape[1] == ids.shape[1] + 1 and int(out[0, -1]) == first
    # Batch of two identical prompts where only the stop set differs is impossible; instead check
    # that a row that finished is padded while another continues.
    two = torch.cat([ids, _prompt([8], seed=6)])
    out2 = tiny.generate(two, max_new_tokens=4, eos_token_id=[first], pad_token_id=480)
    if int(out2[1, ids.shape[1]]) != first:
        assert out2[0, ids.shape[1] + 1:].tolist() == [480] * (out2.shape[1] - ids.shape[1] - 1)
    assert second >= 0


def test_sampling_controls(tiny):
    ids = _prompt([8], seed=9)
    greedy = tiny.generate(ids, max_new_tokens=5, eos_token_id=[])
    top1 = tiny.generate(ids, max_new_tokens=5, eos_token_id=[], do_sample=True, top_k=1,
                         generator=torch.Generator().manual_seed(0))
    assert greedy.tolist() == top1.tolist()
    a = tiny.generate(ids, max_new_tokens=8, eos_token_id=[], do_sample=True, temperature=1.5, top_p=0.9,
                      generator=torch.Generator().manual_seed(123))
    b = tiny.generate(ids, max_new_tokens=8, eos_token_id=[], do_sample=True, temperature=1.5, top_p=0.9,
                      generator=torch.Generator().manual_seed(123))
    assert a.tolist() == b.tolist()
    with pytest.raises(ValueError, match="top_p"):
        tiny.generate(ids, max_new_tokens=2, top_p=0.0)


def test_repetition_penalty_and_filters():
    from keye.model.generation import apply_repetition_penalty, top_k_top_p_filter

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1]]), 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]
    f = top_k_top_p_filter(logits, top_k=2)
    assert torch.isinf(f).tolist() == [[False, True, True, False]]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    f = top_k_top_p_filter(probs, top_p=0.7)  # smallest set with mass >= 0.7 is {0, 1}
    assert torch.isinf(f).tolist() == [[False, False, True, True]]


def test_packed_sft_forward_equals_separate_samples(tiny):
    s1 = _prompt([4, ("img", 6), 6], seed=21)
    s2 = _prompt([3, ("vid", 8), 2, ("img", 4), 5], seed=22)
    g1, g2i, g2v = (1, 4, 6), (1, 4, 4), (2, 4, 4)
    p1, p2i, p2v = _pixels(g1, 1), _pixels(g2i, 2), _pixels(g2v, 3)
    lab1 = s1.clone()
    lab1[:, :5] = -100
    lab2 = s2.clone()
    lab2[:, :10] = -100
    with torch.no_grad():
        o1 = tiny(input_ids=s1, pixel_values=p1, image_grid_thw=torch.tensor([g1]), labels=lab1, loss_reduction="sum")
        o2 = tiny(input_ids=s2, pixel_values=p2i, image_grid_thw=torch.tensor([g2i]), pixel_values_videos=p2v,
                  video_grid_thw=torch.tensor([g2v]), second_per_grid_ts=torch.tensor([1.0]), labels=lab2,
                  loss_reduction="sum")
        packed = tiny(
            input_ids=torch.cat([s1, s2], 1), pixel_values=torch.cat([p1, p2i]),
            image_grid_thw=torch.tensor([g1, g2i]), pixel_values_videos=p2v, video_grid_thw=torch.tensor([g2v]),
            second_per_grid_ts=torch.tensor([1.0]), labels=torch.cat([lab1, lab2], 1),
            seq_lens=[s1.shape[1], s2.shape[1]], loss_reduction="sum",
        )
    n1 = s1.shape[1]
    assert (packed.logits[0, :n1] - o1.logits[0]).abs().max() < 1e-5
    assert (packed.logits[0, n1:] - o2.logits[0]).abs().max() < 1e-5
    assert packed.num_target_tokens == o1.num_target_tokens + o2.num_target_tokens
    assert abs(float(packed.loss) - float(o1.loss + o2.loss)) < 1e-3
    assert packed.position_ids[:, 0, n1:].tolist() == o2.position_ids[:, 0].tolist()


def test_labels_loss_matches_manual_cross_entropy(tiny):
    ids = _prompt([12], seed=4)
    labels = ids.clone()
    labels[:, :6] = -100
    out = tiny(input_ids=ids, labels=labels)
    logp = torch.log_softmax(out.logits[0, :-1].float(), -1)
    tgt = labels[0, 1:]
    keep = tgt != -100
    manual = -logp[keep].gather(1, tgt[keep][:, None]).mean()
    assert abs(out.loss.item() - manual.item()) < 1e-5
    assert out.num_target_tokens == int(keep.sum())


def test_gradient_checkpointing_same_gradients():
    model = make_tiny_model(seed=3).train()
    ids = _prompt([3, ("img", 6), 6], seed=8)
    kw = dict(input_ids=ids, labels=ids, pixel_values=_pixels((1, 4, 6), 0), image_grid_thw=torch.tensor([[1, 4, 6]]))
    model(**kw).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable()
    model(**kw).loss.backward()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], atol=1e-6), n


# -------------------------------------------------------------------------------- placeholders
def test_placeholder_count_mismatch_is_clear(tiny):
    ids = _prompt([3, ("img", 5), 3])
    with pytest.raises(KeyeInputError, match="image"):
        tiny(input_ids=ids, pixel_values=_pixels((1, 4, 6), 0), image_grid_thw=torch.tensor([[1, 4, 6]]))
    with pytest.raises(KeyeInputError, match="no pixel_values"):
        tiny(input_ids=_prompt([3, ("img", 6), 3]))
    with pytest.raises(KeyeInputError, match="pixel rows"):
        tiny(input_ids=_prompt([3, ("img", 6), 3]), pixel_values=_pixels((1, 4, 4), 0),
             image_grid_thw=torch.tensor([[1, 4, 6]]))


# ------------------------------------------------------------------------------------ weights
def test_save_load_round_trip_bit_exact(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "one")
    tiny.save_pretrained(tmp_path / "sharded", max_shard_size=200_000)
    index = json.loads((tmp_path / "sharded/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = _prompt([4, ("img", 6), 4], seed=2)
    kw = dict(input_ids=ids, pixel_values=_pixels((1, 4, 6), 1), image_grid_thw=torch.tensor([[1, 4, 6]]))
    with torch.no_grad():
        ref = tiny(**kw).logits
    for sub in ("one", "sharded"):
        loaded = KeyeVL.from_pretrained(tmp_path / sub)
        for (n, a), (m, b) in zip(tiny.state_dict().items(), loaded.state_dict().items()):
            assert n == m and torch.equal(a, b), n
        with torch.no_grad():
            assert torch.equal(loaded(**kw).logits, ref)
    cfg = json.loads((tmp_path / "one/config.json").read_text())
    assert cfg["architectures"] == ["KeyeForConditionalGeneration"] and "vision_config" in cfg
    assert "text_config" not in cfg and cfg["rope_scaling"]["mrope_section"] == [2, 3, 3]


def test_golden_config_round_trips_losslessly(golden_preview_dir):
    raw = json.loads((golden_preview_dir / "config.json").read_text())
    again = KeyeVLConfig.from_dict(raw).to_dict()
    for key, val in raw.items():
        if key == "vision_config":  # defaults the file leaves implicit are written out explicitly
            assert {k: again[key][k] for k in val} == val
        else:
            assert again[key] == val, key
    assert again["vision_config"]["hidden_act"] == "gelu_pytorch_tanh"


def test_bfloat16_load(golden_preview_dir):
    model = KeyeVL.from_pretrained(golden_preview_dir, torch_dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(input_ids=_prompt([10]))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()


def _write(tmp_path, state, cfg):
    from safetensors.torch import save_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg.to_json_file(tmp_path / "config.json")


def test_loader_accepts_unused_official_tensors_and_rejects_others(tiny, tmp_path):
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    extra = dict(state)
    extra["visual.vision_model.head.probe"] = torch.zeros(1, 1, 48)
    extra["visual.vision_model.head.attention.in_proj_weight"] = torch.zeros(144, 48)
    extra["visual.vision_model.embeddings.packing_position_embedding.weight"] = torch.zeros(32, 48)
    _write(tmp_path / "ok", extra, tiny.config)
    KeyeVL.from_pretrained(tmp_path / "ok")

    bad = dict(state)
    bad["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    del bad["model.layers.1.mlp.up_proj.weight"]
    _write(tmp_path / "bad", bad, tiny.config)
    with pytest.raises(KeyeWeightsError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight.*unexpected tensors: model\.layers\.0\.self_attn\.bogus"):
        KeyeVL.from_pretrained(tmp_path / "bad")

    _write(tmp_path / "v15", state, tiny_config("1.5", text=tiny.config.text))
    with pytest.raises(KeyeWeightsError, match=r"mlp_AR\.pre_norm\.(weight|bias) has shape \[48\], the config expects \[192\]"):
        KeyeVL.from_pretrained(tmp_path / "v15")


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(KeyeWeightsError, match="no such directory"):
        KeyeVL.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyeConfigError, match="no config.json"):
        KeyeVL.from_pretrained(tmp_path / "empty")
    (tmp_path / "cfg").mkdir()
    tiny_config().to_json_file(tmp_path / "cfg/config.json")
    with pytest.raises(KeyeWeightsError, match="no model.safetensors"):
        KeyeVL.from_pretrained(tmp_path / "cfg")
    (tmp_path / "cfg/model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(KeyeWeightsError, match="cannot read safetensors"):
        KeyeVL.from_pretrained(tmp_path / "cfg")
    (tmp_path / "other").mkdir()
    (tmp_path / "other/config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(KeyeConfigError, match="not a Keye-VL config"):
        KeyeVL.from_pretrained(tmp_path / "other")


def test_hub_id_offline_error_is_actionable(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(KeyeWeightsError, match="local directory"):
        KeyeVL.from_pretrained("Kwai-Keye/Keye-VL-1_5-8B")


# -------------------------------------------------------------------------------------- 1.5
def test_v15_projector_norm_after_merge(tiny15):
    assert tuple(tiny15.mlp_AR.pre_norm.weight.shape) == (4 * tiny15.config.vision.hidden_size,)
    x = torch.randn(16, tiny15.config.vision.hidden_size)
    from keye.model.projector import merge_2x2

    p = tiny15.mlp_AR
    manual = p.linear_2(torch.nn.functional.gelu(p.linear_1(p.pre_norm(merge_2x2(x, [(1, 4, 4)], 2)))))
    assert torch.allclose(p(x, [(1, 4, 4)]), manual)


def test_v15_video_frames_are_separate_segments(tiny15):
    """A 1.5 video of T frames is encoded exactly as T independent single-frame items."""
    grid = (3, 4, 6)
    pix = _pixels(grid, 5)
    with torch.no_grad():
        video = tiny15.encode_vision(pix, torch.tensor([grid]), is_video=True)
        frames = torch.cat([tiny15.encode_vision(f, torch.tensor([[1, 4, 6]])) for f in pix.split(24)])
        # The preview variant attends across frames, so the same weights give other numbers there.
    assert (video - frames).abs().max() < 1e-5


def test_v15_mrope_one_block_per_frame(tiny15):
    # text(2) | frame 1: 2x2 merged grid | text(1) | frame 2 (fast, 1x2) | text(1)
    ids = torch.tensor([[5, 6, VID, VID, VID, VID, 7, VID, VID, 8]])
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])
    pos, delta = tiny15.get_rope_index(ids, video_grid_thw=grids)
    assert pos[0, 0].tolist() == [0, 1, 2, 2, 2, 2, 4, 5, 5, 7]
    assert pos[1, 0].tolist() == [0, 1, 2, 2, 3, 3, 4, 5, 5, 7]
    assert pos[2, 0].tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 6, 7]
    assert delta.tolist() == [[8 - 10]]
    # merged rows [k, h, w] of identical frames are split back per frame
    same = torch.tensor([[5, VID, VID, VID, VID, 6, VID, VID, VID, VID]])
    p1, _ = tiny15.get_rope_index(same, video_grid_thw=torch.tensor([[2, 4, 4]]))
    p2, _ = tiny15.get_rope_index(same, video_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))
    assert p1.tolist() == p2.tolist()


def test_v15_end_to_end_forward_and_generate(tiny15):
    frame_ids = [514]  # any text token between frames (e.g. <|frame|> + timestamp digits)
    ids = torch.tensor([[1, 2] + frame_ids + [VID] * 6 + frame_ids + [VID] * 2 + [3]])
    grids = torch.tensor([[1, 4, 6], [1, 2, 4]])
    pix = torch.cat([_pixels((1, 4, 6), 1), _pixels((1, 2, 4), 2)])
    out = tiny15(input_ids=ids, pixel_values_videos=pix, video_grid_thw=grids, num_frames=torch.tensor([2]))
    assert out.logits.shape == (1, ids.shape[1], 520)
    seqs = tiny15.generate(ids, pixel_values_videos=pix, video_grid_thw=grids, max_new_tokens=3, eos_token_id=[])
    assert seqs.shape == (1, ids.shape[1] + 3)


def test_unit_scale_init_is_deterministic():
    a = init_unit_scale(KeyeVL(tiny_config()), seed=5).state_dict()
    b = init_unit_scale(KeyeVL(tiny_config()), seed=5).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_attention_override_reproduces_default(tiny):
    from keye.model.attention import padded_attention

    calls = []

    def causal(q, k, v, *, layer_idx, scale):
        calls.append(layer_idx)
        return padded_attention(q, k, v, None, scale=scale, causal=True)

    ids = _prompt([3, ("img", 6), 5], seed=12)
    kw = dict(input_ids=ids, pixel_values=_pixels((1, 4, 6), 2), image_grid_thw=torch.tensor([[1, 4, 6]]))
    with torch.no_grad():
        ref = tiny(**kw)
        got = tiny(**kw, position_ids=ref.position_ids, attention_override=causal)
    assert calls == [0, 1]
    assert torch.allclose(ref.logits, got.logits, atol=1e-6)
