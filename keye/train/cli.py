"""``keye train sft|rlep`` and ``keye init`` / ``keye merge`` (model building from parts, averaging)."""

from __future__ import annotations

from typing import Any


def add_commands(subparsers: Any) -> None:
    """Register the training commands on the ``keye`` parser."""
    tr = subparsers.add_parser("train", help="run a training recipe (sft, rlep)")
    sub = tr.add_subparsers(dest="recipe", metavar="RECIPE", required=True)
    p = sub.add_parser("sft", help="supervised fine-tuning (stage presets, LoRA, DDP/FSDP2/ZeRO)")
    p.add_argument("--config", help="YAML recipe config (see training/configs/)")
    p.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. train.lr=1e-4 model.path=DIR")
    p.set_defaults(func=_sft)

    p = subparsers.add_parser("init", help="build a fresh Keye model from a Qwen3 LLM and a SigLIP vision checkpoint")
    p.add_argument("--llm", required=True, help="transformers Qwen3ForCausalLM directory")
    p.add_argument("--vision", required=True, help="transformers SiglipVisionModel (or SiglipModel) directory")
    p.add_argument("--out", required=True, help="output directory (official Keye layout)")
    p.add_argument("--variant", choices=["preview", "1.5"], default="1.5")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomly initialised projector")
    p.set_defaults(func=_init)

    p = subparsers.add_parser("merge", help="weighted average of checkpoints of one architecture")
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories")
    p.add_argument("--weights", nargs="+", type=float, help="one weight per checkpoint (default: equal)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_merge)


def _sft(args) -> int:
    from keye.train.sft import run_from_args

    return run_from_args(args.config, args.overrides)


def _init(args) -> int:
    from keye.train.build import init_from_parts

    out = init_from_parts(args.llm, args.vision, args.out, variant=args.variant, seed=args.seed)
    print(f"wrote a fresh Keye-VL ({args.variant}) to {out}")
    return 0


def _merge(args) -> int:
    from keye.train.build import merge_checkpoints

    out = merge_checkpoints(args.checkpoints, args.out, weights=args.weights)
    print(f"wrote the merged checkpoint to {out}")
    return 0
