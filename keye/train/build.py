"""Building checkpoints: a fresh Keye model from a Qwen3 LLM and a SigLIP tower (``keye init``), and
weighted averaging of checkpoints (``keye merge``, the Keye annealing-merge step)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from keye.config import KeyeVLConfig, TextConfig, VisionConfig
from keye.errors import KeyeConfigError, KeyeWeightsError
from keye.model.weights import iter_tensors, save_state_dict

_PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "added_tokens.json", "preprocessor_config.json", "chat_template.json",
                    "chat_template.jinja", "generation_config.json")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KeyeConfigError(f"{path}: not found") from None
    except json.JSONDecodeError as err:
        raise KeyeConfigError(f"{path}: invalid JSON ({err})") from None


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {name: handle.get_tensor(name) for name, _, handle in iter_tensors(directory)}


def init_from_parts(llm_dir: str | Path, vision_dir: str | Path, out_dir: str | Path, *,
                    variant: str = "1.5", seed: int = 0) -> Path:
    """Write a fresh Keye-VL checkpoint: LLM weights from a transformers ``Qwen3ForCausalLM``
    directory, tower weights from a ``SiglipVisionModel`` (or full ``SiglipModel``) directory and a
    randomly initialised projector (LayerNorm 1/0, Linear N(0, initializer_range), zero biases), which
    is Keye's pre-training starting point. The LLM directory's tokenizer files are copied, and the
    special tokens (``<|image_pad|>`` ...) are resolved by name from that tokenizer.
    """
    from transformers import AutoTokenizer

    from keye.model.keye_vl import KeyeVL

    llm_dir, vision_dir, out = Path(llm_dir), Path(vision_dir), Path(out_dir)
    lc = _read_json(llm_dir / "config.json")
    if "Qwen3" not in "".join(lc.get("architectures") or [lc.get("model_type", "")]).replace("qwen3", "Qwen3"):
        raise KeyeConfigError(f"{llm_dir}: expected a Qwen3 checkpoint, config says {lc.get('architectures')}")
    vc = _read_json(vision_dir / "config.json")
    vc = vc.get("vision_config", vc)
    rope_theta = lc.get("rope_theta") or (lc.get("rope_parameters") or {}).get("rope_theta", 1e6)
    head_dim = lc.get("head_dim") or lc["hidden_size"] // lc["num_attention_heads"]
    half = head_dim // 2
    t_sec = half // 4  # Keye/Qwen2-VL split: t gets a quarter of the frequencies, h and w the rest
    mrope = (t_sec, (half - t_sec) // 2, half - t_sec - (half - t_sec) // 2)
    text = TextConfig(
        vocab_size=lc["vocab_size"], hidden_size=lc["hidden_size"], intermediate_size=lc["intermediate_size"],
        num_hidden_layers=lc["num_hidden_layers"], num_attention_heads=lc["num_attention_heads"],
        num_key_value_heads=lc.get("num_key_value_heads", lc["num_attention_heads"]), head_dim=head_dim,
        rms_norm_eps=lc.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta), mrope_section=mrope,
        max_position_embeddings=lc.get("max_position_embeddings", 40960),
        tie_word_embeddings=bool(lc.get("tie_word_embeddings", False)),
    )
    vision = VisionConfig(
        hidden_size=vc["hidden_size"], intermediate_size=vc["intermediate_size"],
        num_hidden_layers=vc["num_hidden_layers"], num_attention_heads=vc["num_attention_heads"],
        image_size=vc.get("image_size", 384), patch_size=vc.get("patch_size", 14),
        hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"), layer_norm_eps=vc.get("layer_norm_eps", 1e-6),
    )
    try:
        tok = AutoTokenizer.from_pretrained(str(llm_dir))
    except Exception as err:  # noqa: BLE001
        raise KeyeConfigError(f"{llm_dir}: cannot load the LLM's tokenizer ({err})") from None
    if variant == "1.5":
        # Keye-VL-1.5 writes each video frame as <|frame|> + timestamp, fast frames inside
        # <|fast_start|>...<|fast_end|>; a Qwen3 tokenizer lacks these, so they are added here.
        new = [t for t in ("<|frame|>", "<|fast_start|>", "<|fast_end|>")
               if tok.convert_tokens_to_ids(t) in (None, tok.unk_token_id)]
        if new:
            tok.add_tokens(new, special_tokens=True)
    ids = {}
    for key, name in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                      ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                      ("vision_token_id", "<|vision_pad|>"), ("eos_token_id", "<|im_end|>"),
                      ("bos_token_id", "<|endoftext|>")):
        tid = tok.convert_tokens_to_ids(name)
        if tid is None or tid == tok.unk_token_id:
            raise KeyeConfigError(f"{llm_dir}: the tokenizer has no {name} token (a Qwen3 tokenizer is required)")
        ids[key] = tid
    grow_to = 0
    if len(tok) > text.vocab_size:
        grow_to = -(-len(tok) // 64) * 64  # keep the embedding row count a multiple of 64
        text.vocab_size = grow_to
    config = KeyeVLConfig(variant=variant, text=text, vision=vision, torch_dtype="float32", **ids)

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = KeyeVL(config)
    state: dict[str, torch.Tensor] = {}
    llm = _tensors(llm_dir)
    for k, v in llm.items():
        if k.startswith(("model.", "lm_head.")) and "rotary_emb" not in k:
            state[k] = v
    if text.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if grow_to:
        # New token rows start at the mean of the existing rows (a neutral, in-distribution init).
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            if key in state:
                old = state[key]
                extra = old.float().mean(0, keepdim=True).expand(grow_to - old.shape[0], -1).to(old.dtype)
                state[key] = torch.cat([old, extra])
    vis = _tensors(vision_dir)
    for k, v in vis.items():
        base = k.removeprefix("vision_model.")
        if k.startswith("text_model.") or k == "logit_scale" or k == "logit_bias" or base.startswith("head.") \
                or "position_ids" in base:
            continue
        state[f"visual.vision_model.{base}"] = v
    proj = model.mlp_AR
    gen = torch.Generator().manual_seed(seed)
    for name, mod in proj.named_modules():
        if isinstance(mod, nn.Linear):
            state[f"mlp_AR.{name}.weight"] = torch.randn(mod.weight.shape, generator=gen) * config.text.initializer_range
            state[f"mlp_AR.{name}.bias"] = torch.zeros(mod.bias.shape)
        elif isinstance(mod, nn.LayerNorm):
            state[f"mlp_AR.{name}.weight"] = torch.ones(mod.weight.shape)
            state[f"mlp_AR.{name}.bias"] = torch.zeros(mod.bias.shape)
    expected = set(model.state_dict())
    if text.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise KeyeWeightsError(f"cannot assemble {out}: missing {missing[:10]}, unexpected {extra[:10]}")
    for k, v in model.state_dict().items():
        if k in state and tuple(state[k].shape) != tuple(v.shape):
            raise KeyeWeightsError(f"{k}: shape {list(state[k].shape)} does not fit the config ({list(v.shape)})")
    dtype = next(iter(llm.values())).dtype
    config.torch_dtype = str(dtype).removeprefix("torch.")
    save_state_dict({k: v.to(dtype) for k, v in state.items()}, out)
    config.to_json_file(out / "config.json")
    if (llm_dir / "generation_config.json").is_file():
        shutil.copy2(llm_dir / "generation_config.json", out / "generation_config.json")
    from keye.processing.processor import KeyeProcessor

    # Writes the (possibly extended) tokenizer, preprocessor_config.json and the official chat template.
    KeyeProcessor(tok, variant=variant).save_pretrained(out)
    return out


def merge_checkpoints(dirs: Sequence[str | Path], out_dir: str | Path, weights: Sequence[float] | None = None) -> Path:
    """Weighted average (in float32) of checkpoints that share one architecture; written in the first
    checkpoint's dtype with its config and processor files. Weights are normalised to sum to 1."""
    dirs = [Path(d) for d in dirs]
    if len(dirs) < 2:
        raise KeyeConfigError("merge needs at least two checkpoints")
    weights = list(weights) if weights else [1.0] * len(dirs)
    if len(weights) != len(dirs):
        raise KeyeConfigError(f"{len(weights)} weights for {len(dirs)} checkpoints")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise KeyeConfigError(f"weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    weights = [w / total for w in weights]
    configs = [KeyeVLConfig.from_json_file(d) for d in dirs]
    ref_cfg = configs[0].to_dict()
    for d, c in zip(dirs[1:], configs[1:]):
        other = c.to_dict()
        for key in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "vision_config"):
            if key == "vision_config":
                a = {k: v for k, v in ref_cfg[key].items() if k not in ("_attn_implementation_autoset",)}
                b = {k: v for k, v in other[key].items() if k not in ("_attn_implementation_autoset",)}
                if a != b:
                    raise KeyeConfigError(f"{d}: vision_config differs from {dirs[0]}")
            elif ref_cfg.get(key) != other.get(key):
                raise KeyeConfigError(f"{d}: {key}={other.get(key)!r} differs from {dirs[0]} ({ref_cfg.get(key)!r})")
    first = _tensors(dirs[0])
    acc = {k: v.float() * weights[0] for k, v in first.items()}
    for d, w in zip(dirs[1:], weights[1:]):
        cur = _tensors(d)
        if set(cur) != set(first):
            diff = sorted(set(cur) ^ set(first))
            raise KeyeWeightsError(f"{d}: tensor names differ from {dirs[0]}: {diff[:10]}")
        for k, v in cur.items():
            if v.shape != first[k].shape:
                raise KeyeWeightsError(f"{d}: {k} has shape {list(v.shape)}, {dirs[0]} has {list(first[k].shape)}")
            acc[k] += v.float() * w
    out = Path(out_dir)
    save_state_dict({k: acc[k].to(first[k].dtype) for k in first}, out)
    configs[0].to_json_file(out / "config.json")
    for f in _PROCESSOR_FILES:
        if (dirs[0] / f).is_file():
            shutil.copy2(dirs[0] / f, out / f)
    return out
