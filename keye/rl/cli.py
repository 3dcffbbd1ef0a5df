"""``keye rl plan``: the per-GPU memory plan of an RL recipe (see :mod:`keye.rl.learner.plan` and docs/rl_memory.md)."""

from __future__ import annotations

import json
from typing import Any

from keye.errors import KeyeConfigError


def add_commands(subparsers: Any) -> None:
    """Register ``keye rl plan`` on the ``keye`` parser."""
    rl = subparsers.add_parser("rl", help="RL tools (memory plan)")
    sub = rl.add_subparsers(dest="rl_command", metavar="COMMAND", required=True)
    p = sub.add_parser("plan", help="per-GPU memory of an RL recipe: learner and rollout phases, and whether it fits")
    p.add_argument("--config", required=True, help="RL recipe YAML (e.g. training/configs/keye_vl_8b_rlep.yaml)")
    p.add_argument("overrides", nargs="*", help="dot-list overrides of the recipe, e.g. algorithm.micro_batch_size=2")
    p.add_argument("--gpus", type=int, default=8, help="learner GPUs (data-parallel / sharding ranks)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU in GiB")
    p.add_argument("--strategy", choices=["fsdp2", "zero3", "ddp"],
                   help="learner strategy (default: the recipe's train.strategy; 'none' plans as ddp)")
    p.add_argument("--model-config", help="config.json (or its directory) to plan for instead of the recipe's model.path")
    p.add_argument("--master-weights", action="store_true", help="float32 master weights, gradients and AdamW states")
    p.add_argument("--ref", choices=["sharded", "cpu", "none"],
                   help="reference model (default: sharded when algorithm.reference or kl_coef > 0, else none)")
    p.add_argument("--logprob-chunk", type=int, default=512, help="rows per log-softmax chunk (0: unchunked)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length in tokens (vision tokens included)")
    p.add_argument("--vision-tokens", type=int, default=1280,
                   help="merged visual tokens per prompt (each is spatial_merge_size^2 patches in the tower)")
    p.add_argument("--engine", choices=["vllm", "keye"], help="rollout engine (default: the recipe's rollout.engine)")
    p.add_argument("--separate", action="store_true", help="the rollout engine runs on its own GPUs (not colocated)")
    p.add_argument("--rollout-gpus", type=int, help="rollout GPUs when --separate (for the report)")
    p.add_argument("--gpu-memory-utilization", default="auto",
                   help="vLLM's fraction of a GPU, or auto (what the learner leaves when colocated, 0.9 alone)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="vLLM max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="vLLM max_num_batched_tokens")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM kv_cache_dtype (auto = the model dtype, or fp8)")
    p.add_argument("--overhead-gb", type=float, default=1.0, help="CUDA context / NCCL / allocator slack per GPU, GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)


def resolve_model_config(model_path: str, explicit: str | None = None):
    """The model config to plan for and its name: :func:`keye.train.plan.resolve_model_config` (imported here, not
    at the top, so that ``keye --help`` imports no torch)."""
    from keye.train.plan import resolve_model_config as resolve

    return resolve(model_path, explicit)


def build_plan(args):
    """The :class:`~keye.rl.learner.plan.MemoryPlan` of parsed ``keye rl plan`` arguments."""
    from keye.rl.config import RLEPConfig
    from keye.rl.learner.plan import plan_memory
    from keye.train.config import load_config
    from keye.train.optim import STAGE_FREEZE

    cfg = load_config(RLEPConfig, args.config, args.overrides)
    model_config, name = resolve_model_config(cfg.model.path, args.model_config)
    for flag in ("gpus", "prompt_tokens", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
        if getattr(args, flag) < 1:
            raise KeyeConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.vision_tokens <= args.prompt_tokens:
        raise KeyeConfigError(f"--vision-tokens must be in [0, --prompt-tokens={args.prompt_tokens}], got {args.vision_tokens}")
    strategy = args.strategy or (cfg.train.strategy if cfg.train.strategy in ("fsdp2", "zero3", "ddp") else "ddp")
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"
    a = cfg.algorithm
    ref = args.ref or ("sharded" if a.reference or a.kl_coef > 0 else "none")
    frozen = list(cfg.train.freeze) if cfg.train.stage == "custom" else STAGE_FREEZE[cfg.train.stage]
    # one padded micro-batch of the update: micro_batch_size rows of prompt + response, each with its visuals
    rows = a.micro_batch_size
    new = cfg.rollout.max_new_tokens
    length = args.prompt_tokens + new
    merge2 = model_config.vision.spatial_merge_size ** 2
    engine = args.engine or ("keye" if cfg.rollout.engine == "local" else "vllm")
    util = args.gpu_memory_utilization
    rollout = {"engine": engine, "colocated": not args.separate,
               "gpu_memory_utilization": util if util == "auto" else float(util),
               "max_num_seqs": args.max_num_seqs, "max_model_len": length,
               "max_num_batched_tokens": args.max_num_batched_tokens, "tensor_parallel_size": args.tensor_parallel_size,
               "kv_cache_dtype": args.kv_cache_dtype, "gpus": args.rollout_gpus,
               "max_batch_size": cfg.rollout.max_batch_size}
    return plan_memory(
        model_config, world_size=args.gpus, strategy=strategy, dtype=dtype, master_weights=args.master_weights,
        micro_batch_tokens=rows * length, micro_batch_sequences=rows, vision_patches=rows * args.vision_tokens * merge2,
        response_tokens=rows * new, padded=True, gradient_checkpointing=cfg.model.gradient_checkpointing,
        logprob_chunk=args.logprob_chunk or None, ref=ref, frozen=frozen, rollout=rollout,
        gpu_memory_gb=args.gpu_memory_gb, overhead_gb=args.overhead_gb, model_name=name,
    ), cfg


def _plan(args) -> int:
    try:
        float(args.gpu_memory_utilization) if args.gpu_memory_utilization != "auto" else None
    except ValueError:
        raise KeyeConfigError(f"--gpu-memory-utilization must be a number or auto, got {args.gpu_memory_utilization!r}") from None
    plan, cfg = build_plan(args)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(plan.table())
    a = cfg.algorithm
    print(f"micro-batch: {a.micro_batch_size} rows x ({args.prompt_tokens} prompt incl. {args.vision_tokens} visual + "
          f"{cfg.rollout.max_new_tokens} response) tokens, padded; gradient checkpointing "
          f"{'on' if cfg.model.gradient_checkpointing else 'off'}")
    from keye.rl.config import tree_enabled

    if tree_enabled(cfg):
        print("note: tree.enabled: the update would run shared-prefix tree batches; this plan models padded "
              "micro-batches (tree.enabled=false). See docs/rl_memory.md.")
    return 0
