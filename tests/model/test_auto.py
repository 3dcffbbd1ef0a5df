"""transformers' auto classes load Keye-VL checkpoints (registered by ``import keye``), without remote code."""

from __future__ import annotations

import json

import pytest
import torch

import keye
from keye import KeyeVL
from keye.config import KeyeVL1_5Config, KeyeVLConfig
from keye.processing.processor import KeyeProcessor


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """keye-tiny saved by keye (model + processor files) into a fresh directory."""
    model, processor = keye.load_tiny()
    d = tmp_path_factory.mktemp("keye_tiny_saved")
    model.save_pretrained(d)
    processor.save_pretrained(d)
    return d, model, processor


def _messages():
    return [{"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]}]


def test_auto_config_knows_both_model_types(golden_preview_dir, saved_tiny):
    from transformers import AutoConfig

    preview = AutoConfig.from_pretrained(golden_preview_dir)
    assert type(preview) is KeyeVLConfig and preview.variant == "preview"
    # The official file's auto_map (remote code) is kept verbatim but not used.
    assert preview.to_dict()["auto_map"] == json.loads((golden_preview_dir / "config.json").read_text())["auto_map"]
    v15 = AutoConfig.from_pretrained(saved_tiny[0])
    assert type(v15) is KeyeVL1_5Config and v15.variant == "1.5"
    assert v15.num_hidden_layers == v15.text.num_hidden_layers


def test_auto_model_and_processor_round_trip_keye_tiny(saved_tiny):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d, model, processor = saved_tiny
    auto_model = AutoModelForImageTextToText.from_pretrained(d)
    auto_proc = AutoProcessor.from_pretrained(d)
    assert isinstance(auto_model, KeyeVL) and isinstance(auto_proc, KeyeProcessor)
    assert auto_proc.variant == "1.5" and auto_proc.token_ids == processor.token_ids
    ref = model.state_dict()
    for name, tensor in auto_model.state_dict().items():
        assert torch.equal(tensor, ref[name]), name
    batch = processor(_messages())
    auto_batch = auto_proc(_messages())
    assert auto_batch["input_ids"].tolist() == batch["input_ids"].tolist()
    ours = model.generate(**batch, max_new_tokens=8, do_sample=False)
    theirs = auto_model.generate(**auto_batch, max_new_tokens=8, do_sample=False)
    assert theirs.tolist() == ours.tolist()


def test_auto_causal_lm_on_official_preview_config_needs_no_remote_code(golden_preview_dir):
    from transformers import AutoModelForCausalLM

    # The golden config.json names remote code for AutoModelForCausalLM in its auto_map; the registered
    # local class must win (the directory holds no modeling_keye.py, so remote code would fail).
    auto = AutoModelForCausalLM.from_pretrained(golden_preview_dir, dtype=torch.float32)
    direct = KeyeVL.from_pretrained(golden_preview_dir, torch_dtype="float32")
    assert isinstance(auto, KeyeVL)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        assert torch.equal(auto(input_ids=ids).logits, direct(input_ids=ids).logits)


def test_device_map_auto_and_dtype_through_auto_class(saved_tiny):
    from transformers import AutoModelForImageTextToText

    d, model, processor = saved_tiny
    auto = AutoModelForImageTextToText.from_pretrained(d, device_map="auto", low_cpu_mem_usage=True,
                                                       dtype=torch.bfloat16)
    assert auto.dtype == torch.bfloat16
    # accelerate planned the placement (one CPU here) and the model was dispatched with it.
    assert set(auto.hf_device_map.values()) == {"cpu"}
    split = {"visual": "cpu", "mlp_AR": "cpu", "model.embed_tokens": "cpu", "model.layers": "cpu",
             "model.norm": "cpu", "lm_head": "cpu"}
    mapped = KeyeVL.from_pretrained(d, device_map=split, torch_dtype="float32")
    batch = processor(_messages())
    with torch.no_grad():
        assert torch.equal(mapped(**batch).logits, model(**batch).logits)
    with pytest.raises(TypeError, match="unsupported argument"):
        KeyeVL.from_pretrained(d, quantization_config={"bits": 4})


def test_generation_config_file_round_trip(saved_tiny, tmp_path):
    d, model, processor = saved_tiny
    loaded = KeyeVL.from_pretrained(d)
    loaded.generation_config.max_new_tokens = 5
    loaded.generation_config.repetition_penalty = 1.3
    loaded.save_pretrained(tmp_path / "gen")
    written = json.loads((tmp_path / "gen/generation_config.json").read_text())
    assert written["max_new_tokens"] == 5 and written["repetition_penalty"] == 1.3
    again = KeyeVL.from_pretrained(tmp_path / "gen")
    assert again.generation_config.max_new_tokens == 5
    assert again.generation_config.eos_token_id == model.generation_config.eos_token_id
    batch = processor(_messages())
    # The file's settings are generate's defaults: 5 new tokens at most, with the penalty applied.
    out = again.generate(**batch, eos_token_id=[])
    ref = model.generate(**batch, max_new_tokens=5, repetition_penalty=1.3, eos_token_id=[])
    assert out.shape[1] == batch["input_ids"].shape[1] + 5 and out.tolist() == ref.tolist()
