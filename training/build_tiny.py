"""Rebuild the embedded default model ``keye-tiny`` from scratch, offline, on a CPU.

Steps (each skipped when its output already exists, so the script is resumable):
  1. the synthetic video-QA set      data/synth/{train,test}.jsonl + train_captions.jsonl   (keye.data.synth)
  2. a byte-level BPE tokenizer trained on the set's questions, answers and captions, with the Keye
     special tokens
  3. a randomly initialised Keye-VL-1.5-style model (~3M parameters) + processor files   runs/tiny/init
  4. SFT stage 0, look: captions of large-object warm-up images (data/synth/warmup.jsonl)
                                                                        runs/tiny_stage0/final
     (training/configs/tiny_synth_stage0.yaml)
     SFT stage 1, perception: the warm-up images and dense captions of the training clips
                                                                        runs/tiny_stage1/final
     (training/configs/tiny_synth_stage1.yaml)
  5. SFT stage 2, the questions (plus the captions, so perception is kept) runs/tiny/final
     (training/configs/tiny_synth.yaml)
  6. held-out evaluation with ``keye eval synth``, real clips and blank clips  runs/tiny/eval{,_blank}
  7. copy into the package                                             keye/assets/keye-tiny

Why stages: trained on the questions alone, a from-scratch model settles on the answer priors of the
text and never discovers the pixels (its accuracy with blank clips equals its accuracy with real ones).
The captions ask for what is in every frame, token by token, which is a direct and dense signal, and the
warm-up images with large objects make that signal strong enough to find from a random init (on the
real clips' small objects alone it is not found in the budget); once the model looks, the questions teach
it to reason over what it sees. It is Keye's own order (perception and
captioning before instruction data) in miniature.

Usage: python training/build_tiny.py [--train 10000] [--test 500] [--warmup 3000] [--install] [stage2 overrides ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# Small frames so a 2-core CPU can train and serve the model: images and slow video frames at most
# 112x112 (16 tokens), a 4-token floor for fast frames, 2 fps (the synthetic events sit on a 0.5 s
# grid), up to 16 frames. Fewer tokens per frame also means a bigger share of each token is object,
# which is what lets a from-scratch model start using the pixels.
MAX_PIXELS = 12544
VIDEO_DEFAULTS = {"floor_pixels": 3136, "max_pixels": MAX_PIXELS, "fps": 2.0, "max_frames": 16}


def corpus(*manifests: Path) -> list[str]:
    """Every text the model will read or write: prompts, answers, captions, frame timestamps."""
    lines = []
    for row in (r for m in manifests for r in m.read_text().splitlines()):
        r = json.loads(row)
        for m in r["messages"]:
            for c in m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]:
                if c.get("type") == "text":
                    lines.append(c["text"])
    lines += [f"{t / 2:.1f}" for t in range(0, 64)]
    lines.append("You are a helpful assistant. /think /no_think <think> </think> <answer> </answer>")
    return lines


def build_init(out: Path, *train_manifests: Path, seed: int = 0) -> None:
    """Tokenizer + random model + processor files in ``out``."""
    from keye.config import KeyeVLConfig, TextConfig, VisionConfig
    from keye.model.keye_vl import KeyeVL
    from keye.processing.image import ImageProcessorConfig
    from keye.processing.processor import KeyeProcessor
    from keye.processing.tokenizer import save_tokenizer, train_tiny_tokenizer

    n_ordinary = 480
    tok = train_tiny_tokenizer(corpus(*train_manifests), n_ordinary=n_ordinary, variant="1.5")
    save_tokenizer(tok, out, variant="1.5")
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(out), trust_remote_code=False)
    ids = {name: hf_tok.convert_tokens_to_ids(tok_) for name, tok_ in (
        ("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"), ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"), ("vision_token_id", "<|vision_pad|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    vocab = -(-len(hf_tok) // 64) * 64
    config = KeyeVLConfig(
        variant="1.5",
        text=TextConfig(vocab_size=vocab, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=32, mrope_section=(4, 6, 6),
                        max_position_embeddings=8192, rope_theta=10000.0),
        vision=VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                            image_size=112, patch_size=14),
        torch_dtype="float32", **ids,
    )
    torch.manual_seed(seed)
    model = KeyeVL(config)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv2d)):
                torch.nn.init.normal_(mod.weight, std=0.02)
                if getattr(mod, "bias", None) is not None:
                    torch.nn.init.zeros_(mod.bias)
    model.save_pretrained(out)
    image_config = ImageProcessorConfig(variant="1.5", max_pixels=MAX_PIXELS, video_defaults=dict(VIDEO_DEFAULTS))
    KeyeProcessor(hf_tok, image_config, variant="1.5").save_pretrained(out)
    print(f"init: {model.num_parameters() / 1e6:.2f}M parameters, vocab {vocab} -> {out}")


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=10000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=3000, help="large-object caption images for stage 1")
    ap.add_argument("--install", action="store_true", help="copy the result into keye/assets/keye-tiny")
    ap.add_argument("overrides", nargs="*", help="extra stage-2 SFT overrides (key=value)")
    args = ap.parse_args()
    synth = REPO / "data/synth"
    if not (synth / "test.jsonl").is_file():
        from keye.data.synth import generate

        generate(synth, train=args.train, test=args.test, seed=0)
    if not (synth / "warmup.jsonl").is_file():
        from keye.data.synth import generate_split

        generate_split(synth, "warmup", args.warmup, seed=0)
    stage1 = synth / "stage1.jsonl"
    if not stage1.is_file():  # stage 1 data: large-object warm-up images and the clips' captions
        stage1.write_text((synth / "warmup.jsonl").read_text() + (synth / "train_captions.jsonl").read_text())
    mix = synth / "train_mix.jsonl"
    if not mix.is_file():  # stage 2 data: the questions and the captions, shuffled together by the loader
        mix.write_text((synth / "train.jsonl").read_text() + (synth / "train_captions.jsonl").read_text())
    init = REPO / "runs/tiny/init"
    if not (init / "model.safetensors").is_file():
        build_init(init, synth / "train.jsonl", synth / "train_captions.jsonl")
    for stage in ("stage0", "stage1"):
        if not (REPO / f"runs/tiny_{stage}/final/model.safetensors").is_file():
            run([sys.executable, "-m", "keye", "train", "sft", "--config", f"training/configs/tiny_synth_{stage}.yaml"])
    run([sys.executable, "-m", "keye", "train", "sft", "--config", "training/configs/tiny_synth.yaml", *args.overrides])
    for name, extra in (("eval", []), ("eval_blank", ["--blank"])):
        run([sys.executable, "-m", "keye", "eval", "synth", "--model", "runs/tiny/final", "--data",
             str(synth / "test.jsonl"), "--out", f"runs/tiny/{name}", "--max-new-tokens", "8", "--batch-size", "16",
             *extra])
    if args.install:
        dest = REPO / "keye/assets/keye-tiny"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(REPO / "runs/tiny/final", dest)
        print(f"installed keye-tiny -> {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
