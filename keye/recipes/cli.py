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
    p = sub.add_parser("rlep", help="GRPO-family RL with experience replay (RLEP), dynamic sampling, tree updates")
    p.add_argument("--config", help="YAML recipe config (see training/configs/)")
    p.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. replay.M=0 model.path=DIR")
    p.set_defaults(func=_rlep)

    rl = subparsers.add_parser("rlep", help="RLEP tools (phase A: collect the replay pool)")
    rsub = rl.add_subparsers(dest="rlep_command", metavar="COMMAND", required=True)
    p = rsub.add_parser("collect", help="sample n answers per question from a policy and keep the verified ones")
    p.add_argument("--policy", required=True, help="checkpoint directory of the seed policy (weights + processor)")
    p.add_argument("--data", required=True, help="RL manifest (JSONL with answer / answer_kind columns)")
    p.add_argument("--out", required=True, help="pool JSONL to write")
    p.add_argument("--n", type=int, default=64, help="answers sampled per question")
    p.add_argument("--min-successes", type=int, default=2, help="distinct verified answers needed to keep a question")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: keep the smallest token set of this mass")
    p.add_argument("--max-new-tokens", type=int, default=3072, help="answer budget in tokens")
    p.add_argument("--reward", help="reward spec YAML (default: format + accuracy)")
    p.add_argument("--engine", choices=["local", "vllm"], default="local",
                   help="generate in this process (local) or with vLLM")
    p.add_argument("--batch-prompts", type=int, default=8, help="questions per generation call")
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together (local engine)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the model's default)")
    p.set_defaults(func=_rlep_collect)

    p = subparsers.add_parser("init", help="build a fresh Keye model from a Qwen3 LLM and a SigLIP vision checkpoint")
    p.add_argument("--llm", required=True, help="transformers Qwen3ForCausalLM directory")
    p.add_argument("--vision", required=True, help="transformers SiglipVisionModel (or SiglipModel) directory")
    p.add_argument("--out", required=True, help="output directory (official Keye layout)")
    p.add_argument("--variant", choices=["preview", "1.5"], default="1.5",
                   help="Keye-VL-8B-Preview or Keye-VL-1.5 layout")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomly initialised projector")
    p.set_defaults(func=_init)

    p = subparsers.add_parser("merge", help="weighted average of checkpoints of one architecture")
    p.add_argument("checkpoints", nargs="+", help="checkpoint directories")
    p.add_argument("--weights", nargs="+", type=float, help="one weight per checkpoint (default: equal)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=_merge)


def _sft(args) -> int:
    from keye.recipes.sft import run_from_args

    return run_from_args(args.config, args.overrides)


def _rlep(args) -> int:
    from keye.recipes.rlep import run_from_args

    return run_from_args(args.config, args.overrides)


def _rlep_collect(args) -> int:
    from keye.rl import collect_to_file

    def progress(st) -> None:
        print(f"\r{st.questions} questions, {st.kept} kept, pass rate {st.mean_pass_rate:.3f}", end="", flush=True)

    stats = collect_to_file(args.policy, args.data, args.out, n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, min_successes=args.min_successes, reward=args.reward,
                            engine=args.engine, batch_prompts=args.batch_prompts, max_batch_size=args.max_batch_size,
                            seed=args.seed, device=args.device, progress=progress)
    print(f"\ncollected {stats.successes} verified answers of {stats.candidates}; kept {stats.kept} of "
          f"{stats.questions} questions (mean pass rate {stats.mean_pass_rate:.3f}); wrote {args.out}")
    return 0


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
