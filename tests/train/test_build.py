"""keye init (fresh model from transformers Qwen3 + SigLIP parts) and keye merge (weight averaging)."""

from __future__ import annotations

import pytest
import torch

from keye import KeyeProcessor, KeyeVL
from keye.cli import main as cli_main
from keye.errors import KeyeConfigError, KeyeWeightsError
from keye.testing.model import save_tiny_checkpoint
from keye.testing.processor import make_tiny_processor_dir


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM, SiglipVisionConfig, SiglipVisionModel

    root = tmp_path_factory.mktemp("parts")
    torch.manual_seed(0)
    llm = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False))
    llm.save_pretrained(root / "llm")
    make_tiny_processor_dir(root / "tok", variant="preview")
    for f in (root / "tok").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (root / "llm" / f.name).write_bytes(f.read_bytes())
    vis = SiglipVisionModel(SiglipVisionConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=112, patch_size=14))
    vis.save_pretrained(root / "vision")
    return root, llm, vis


def test_init_from_parts_builds_a_working_model(parts, tmp_path):
    root, llm, vis = parts
    assert cli_main(["init", "--llm", str(root / "llm"), "--vision", str(root / "vision"),
                     "--out", str(tmp_path / "keye"), "--variant", "1.5"]) == 0
    model = KeyeVL.from_pretrained(tmp_path / "keye")
    assert model.config.variant == "1.5" and model.config.image_token_id == 492
    assert model.config.text.mrope_section == (2, 3, 3)
    ours = model.state_dict()
    # The 1.5 frame tokens were added to the Qwen3 tokenizer, growing the vocabulary past 512 rows.
    assert model.config.text.vocab_size == 576 and KeyeProcessor.from_pretrained(tmp_path / "keye").token_ids["<|frame|>"] == 512
    for k, v in llm.state_dict().items():
        if "rotary" not in k:
            assert torch.equal(ours[k][: v.shape[0]], v), k
    for k, v in vis.state_dict().items():
        key = "visual.vision_model." + k.removeprefix("vision_model.")
        if k.removeprefix("vision_model.").startswith("head.") or "position_ids" in k:
            continue
        assert torch.equal(ours[key], v), k
    assert torch.equal(ours["mlp_AR.pre_norm.weight"], torch.ones(4 * 48))
    # Text-only logits equal the source LLM's (mRoPE reduces to 1-D RoPE for text).
    ids = torch.randint(0, 480, (1, 12))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits[..., :512], llm(input_ids=ids).logits, atol=1e-5)
    proc = KeyeProcessor.from_pretrained(tmp_path / "keye")
    assert proc.variant == "1.5"


def test_init_rejects_wrong_parts(parts, tmp_path):
    root, _, _ = parts
    from keye.train.build import init_from_parts

    with pytest.raises(KeyeConfigError, match="expected a Qwen3 checkpoint"):
        init_from_parts(root / "vision", root / "vision", tmp_path / "x")
    with pytest.raises(KeyeConfigError, match="not found"):
        init_from_parts(root / "llm", tmp_path / "missing", tmp_path / "x")


def test_merge_is_a_weighted_average(tmp_path):
    for i in range(3):
        save_tiny_checkpoint(tmp_path / f"c{i}", "preview", seed=i)
    assert cli_main(["merge", str(tmp_path / "c0"), str(tmp_path / "c1"), str(tmp_path / "c2"),
                     "--weights", "2", "1", "1", "--out", str(tmp_path / "m")]) == 0
    sds = [KeyeVL.from_pretrained(tmp_path / f"c{i}").state_dict() for i in range(3)]
    merged = KeyeVL.from_pretrained(tmp_path / "m").state_dict()
    for k in merged:
        expect = 0.5 * sds[0][k] + 0.25 * sds[1][k] + 0.25 * sds[2][k]
        assert torch.allclose(merged[k], expect, atol=1e-6), k


def test_merge_rejects_mismatched_architectures(tmp_path):
    save_tiny_checkpoint(tmp_path / "a", "preview", seed=0)
    save_tiny_checkpoint(tmp_path / "b", "1.5", seed=0)
    from keye.train.build import merge_checkpoints

    with pytest.raises((KeyeConfigError, KeyeWeightsError)):
        merge_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    with pytest.raises(KeyeConfigError, match="2 weights for 3"):
        merge_checkpoints([tmp_path / "a"] * 3, tmp_path / "m", weights=[1, 1])
    assert cli_main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 1
