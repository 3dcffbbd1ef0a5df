"""Config schema of the RL recipe (``keye train rlep``): the YAML sections, :class:`RLEPConfig`, and the
cross-field checks and derived settings every RL loop shares (in-process, Ray sync and Ray async).

Light on purpose: it defines dataclasses and checks, builds no model and imports no Ray, so the CLI, the
planners and the tests can load and validate a config cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from keye.errors import KeyeConfigError
from keye.rl.algorithms.advantages import DifficultyCurve
from keye.rl.algorithms.autothink import AutoThinkConfig
from keye.rl.algorithms.losses import KL_LOSS_ESTIMATORS
from keye.rl.algorithms.sampling import ModeMix
from keye.train.sections import CheckpointSection, LogSection, ModelSection, OptimSection

DEFAULT_ASYNC_TIS_CAP = 2.0
"""Truncation of the behaviour importance weight when ``algorithm.tis_cap`` is unset in async mode."""


@dataclass
class RLDataSection:
    """RL prompts: the manifest, how many per step, order, optional pre-run accuracy filter."""

    manifest: str = "data/synth/train.jsonl"  # RL prompt manifest (answer / answer_kind / choices columns)
    limit: int | None = None  # use only the first N prompts
    prompts_per_step: int = 4  # groups per step over all ranks (divisible by the world size)
    shuffle: bool = True  # new seeded permutation every epoch
    filter_samples: int = 0  # > 0: keep prompts whose accuracy over this many samples is in (0, 1)


@dataclass
class RolloutSection:
    """Sampling of the fresh responses (G per prompt) and the engine that does it."""

    engine: Literal["local", "vllm"] = "local"
    G: int = 8  # fresh responses per prompt
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_batch_size: int = 64  # sequences decoded together (local engine)
    sync_bytes: int = 512 * 2**20  # weight shards sent to the rollout engine after each update
    colocate: bool = True  # vllm: sleep between rollouts (frees the GPU memory the learner needs)


@dataclass
class ReplaySection:
    """RLEP phase B: the pool file, M replayed successes per group, online growth."""

    enabled: bool = True
    pool: str | None = None  # JSONL from `keye rlep collect` (None: start empty, online growth only)
    M: int = 2  # replayed successes per group
    online: bool = True  # add new verified successes to the pool
    max_per_question: int | None = None
    overflow: Literal["drop_new", "drop_oldest"] = "drop_new"
    match_mode: bool = True  # replay only answers recorded in the prompt's thinking mode


@dataclass
class AlgorithmSection:
    """Advantages, PPO loss (clip-higher, dual clip, GSPO, KL), update schedule, difficulty awareness."""

    std: Literal["unbiased", "population", "none"] = "unbiased"  # "none" = Dr.GRPO
    eps: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher
    dual_clip: float | None = 10.0
    ratio_level: Literal["token", "sequence"] = "token"  # sequence = GSPO
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    loss_scale_factor: float | None = None  # Dr.GRPO constant of seq-mean-token-sum-norm; None: rollout.max_new_tokens
    kl_coef: float = 0.0
    kl_reward_coef: float = 0.0  # k1 KL penalty in the reward (verl use_kl_in_reward); needs reference: true
    # KL loss estimator: k2 or k3 (= low_var_kl); k1 has zero expected gradient, so it is rejected with kl_coef > 0
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    reference: bool = False  # keep a frozen reference model (needed for kl_coef > 0; KL is logged when kl_coef > 0)
    reference_path: str | None = None  # default: model.path
    # where the reference model lives: auto (sharded like the policy under fsdp2/zero3, else on the device),
    # sharded, cpu (no accelerator memory; slower) or device
    reference_placement: Literal["auto", "sharded", "cpu", "device"] = "auto"
    # truncated importance sampling between the rollout engine and the learner (verl's tis_imp_ratio_cap):
    # each token's policy-gradient term is weighted by min(exp(old_logp - rollout_logp), tis_cap); None: off
    tis_cap: float | None = None
    entropy_coef: float = 0.0
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer updates per epoch over the rollout batch (whole groups each)
    micro_batch_size: int = 8  # sequences per forward (padded path)
    dynamic_sampling: bool = False
    dynamic_sampling_metric: Literal["accuracy", "reward"] = "accuracy"  # DAPO: drop groups with equal accuracy
    max_rounds: int = 4
    oversample: float = 1.0
    difficulty: Any = None  # None, a preset name (flat, mixed_up, solved_down) or [[pass_rate, scale], ...]
    mode_mix: dict[str, float] | None = None  # e.g. {think: 1, no_think: 1, auto: 1}; None = prompts as given
    # AutoThink mode-selection reward: each prompt -> linked auto / forced-think / forced-direct groups
    # (keye/rl/algorithms/autothink.py, docs/autothink.md); synchronous loops only (in process or rl.engine=ray)
    autothink: AutoThinkConfig = field(default_factory=AutoThinkConfig)


@dataclass
class RewardSection:
    """The reward (a :class:`keye.rewards.RewardSpec` mapping) and the notion of a verified success."""

    spec: dict[str, Any] = field(default_factory=lambda: {"rewards": ["accuracy", "format"]})  # RewardSpec.from_dict
    pass_value: float = 1.0  # a response "passed" when its accuracy part is >= this


@dataclass
class TreeSection:
    """Shared-prefix (tree) forward for the old/reference log-probs and the update."""

    enabled: bool | None = None  # None: on when G + M >= 2 (a group shares its prompt)
    kernel: Literal["efficient", "reference"] = "efficient"
    groups_per_micro_batch: int = 1  # groups (trees) per forward


@dataclass
class RLTrainSection(OptimSection):
    """The shared optimisation fields (RL defaults: lr 1e-6, constant schedule), ``steps`` = RL steps, and the
    learner's parallel strategy."""

    lr: float = 1e-6
    schedule: Literal["cosine", "linear", "constant"] = "constant"
    steps: int = 100  # RL steps (rollout batches)
    # none / ddp: replicated policy; fsdp2 / zero3: sharded learner (keye/rl/learner/learner.py); zero3 reads
    # deepspeed_config (default keye.rl.learner.learner.DEFAULT_ZERO3)
    strategy: Literal["none", "ddp", "fsdp2", "zero3"] = "none"


@dataclass
class EvalSection:
    """Periodic held-out accuracy, greedy and optionally avg@k sampled (metrics and ``eval_curve.json``)."""

    manifest: str | None = None  # held-out manifest; None disables evaluation
    limit: int | None = 100
    every: int = 0  # steps between evaluations (0: only before and after training)
    max_new_tokens: int = 32
    batch_size: int = 16
    samples: int = 0  # > 0: also avg@k accuracy over k answers sampled at `temperature` per prompt
    temperature: float = 1.0


@dataclass
class RaySection:
    """Where the Ray components run (``rl.engine: ray``; keye/rl/distributed/, docs/rl_ray.md)."""

    address: str | None = None  # None: start a local cluster with this machine's CPUs; "auto": join `ray start`
    num_cpus: int | None = None  # local cluster only: CPUs it offers (None: all of this machine's)
    learners: int = 1  # learner actors = ranks of one torch process group (train.strategy across them)
    rollout_workers: int = 1  # actors holding a whole-weight rollout engine (prompts split by index)
    # actors scoring in parallel, a share that dies or hangs re-run elsewhere (0: score in the driver; None: 2 in
    # sync mode, 0 in async mode, whose driver has no other CPU-bound work)
    reward_workers: int | None = None
    reward_timeout_s: float = 60.0  # a reward call slower than this is killed and re-run on a new worker
    max_restarts: int = 3  # restarts of one worker within one call (and of the learner group per run) before failing
    learner_cpus: float = 1.0
    learner_gpus: float | None = None  # None: 1 when the cluster has GPUs, else 0
    rollout_cpus: float = 1.0
    rollout_gpus: float | None = None  # None: 1 when the cluster has GPUs, else 0
    reward_cpus: float = 1.0
    torch_threads: int | None = None  # torch CPU threads per actor (None: its whole CPUs, at least 1)
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # one placement group, all actors
    placement_timeout_s: float = 300.0  # fail with the missing resources when the group cannot be placed
    # learner -> rollout workers: object_store (shards put once, every worker fetches them), broadcast (a
    # process group of learner rank 0 and the workers: NCCL on GPUs, gloo on CPUs), auto (broadcast when
    # the learners and rollout workers all have GPUs)
    weight_sync: Literal["auto", "object_store", "broadcast"] = "auto"
    sync_timeout_s: float = 600.0  # broadcast: a collective that does not complete in time fails (and is retried)


@dataclass
class RLSection:
    """How the RL loop is executed: in this process group (``process``) or on Ray actors (``ray``)."""

    engine: Literal["process", "ray"] = "process"
    mode: Literal["sync", "async"] = "sync"  # sync: the on-policy loop; async needs rl.engine=ray
    max_staleness: int = 1  # async: weight versions an answer may lag the learner
    # async: streaming (each group's gradient is accumulated as soon as it is complete and scored, the optimizer
    # steps when the batch is whole), barrier (the update starts when the whole batch is in), auto (streaming
    # when the update is one optimizer step: algorithm.ppo_epochs = mini_batches = 1); sync mode is barrier
    update: Literal["auto", "streaming", "barrier"] = "auto"
    ray: RaySection = field(default_factory=RaySection)


@dataclass
class RLEPConfig:
    """The whole ``keye train rlep`` config (YAML sections of the same names)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: RLDataSection = field(default_factory=RLDataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    replay: ReplaySection = field(default_factory=ReplaySection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    reward: RewardSection = field(default_factory=RewardSection)
    tree: TreeSection = field(default_factory=TreeSection)
    train: RLTrainSection = field(default_factory=RLTrainSection)
    checkpoint: CheckpointSection = field(default_factory=lambda: CheckpointSection(out_dir="runs/rlep"))
    log: LogSection = field(default_factory=lambda: LogSection(tensorboard=False))
    eval: EvalSection = field(default_factory=EvalSection)
    rl: RLSection = field(default_factory=RLSection)


def validate(cfg: RLEPConfig, world_size: int = 1) -> None:
    """Cross-field checks; raises :class:`KeyeConfigError` naming the key."""
    a, r = cfg.algorithm, cfg.rollout
    if cfg.model.preprocessor:
        # Rollout workers load the processor from a path of their own; a per-run override would not reach them.
        raise KeyeConfigError("model.preprocessor is an SFT option: RL reads preprocessor_config.json from the "
                              "checkpoint (or model.processor); export one trained at that budget with SFT")
    if r.G < 1:
        raise KeyeConfigError(f"rollout.G must be >= 1, got {r.G}")
    if cfg.replay.M < 0:
        raise KeyeConfigError(f"replay.M must be >= 0, got {cfg.replay.M}")
    if cfg.data.prompts_per_step < 1 or cfg.data.prompts_per_step % world_size:
        raise KeyeConfigError(f"data.prompts_per_step ({cfg.data.prompts_per_step}) must be a positive multiple of "
                              f"the world size ({world_size})")
    if a.kl_coef and not a.reference:
        raise KeyeConfigError("algorithm.kl_coef > 0 needs algorithm.reference: true")
    if a.kl_reward_coef < 0 or (a.kl_reward_coef and not a.reference):
        raise KeyeConfigError(f"algorithm.kl_reward_coef must be >= 0 and > 0 needs algorithm.reference: true "
                              f"(got {a.kl_reward_coef}, reference={a.reference})")
    if a.kl_coef and a.kl_estimator not in KL_LOSS_ESTIMATORS:
        raise KeyeConfigError(f"algorithm.kl_estimator: {a.kl_estimator!r} cannot be a loss term (algorithm.kl_coef > 0): "
                              f"its expected gradient is zero; use one of {list(KL_LOSS_ESTIMATORS)} (k1 belongs in the "
                              "reward: algorithm.kl_reward_coef)")
    if a.loss_scale_factor is not None and a.loss_scale_factor <= 0:
        raise KeyeConfigError(f"algorithm.loss_scale_factor must be > 0 (or null), got {a.loss_scale_factor}")
    for key in ("ppo_epochs", "mini_batches", "micro_batch_size", "max_rounds"):
        if getattr(a, key) < 1:
            raise KeyeConfigError(f"algorithm.{key} must be >= 1, got {getattr(a, key)}")
    if cfg.tree.groups_per_micro_batch < 1:
        raise KeyeConfigError(f"tree.groups_per_micro_batch must be >= 1, got {cfg.tree.groups_per_micro_batch}")
    if a.difficulty is not None:
        DifficultyCurve.from_config(a.difficulty)
    ModeMix.from_config(a.mode_mix)
    if a.autothink.enabled:
        _validate_autothink(cfg)
    if cfg.train.steps < 1:
        raise KeyeConfigError(f"train.steps must be >= 1, got {cfg.train.steps}")
    if a.tis_cap is not None and a.tis_cap < 1.0:
        raise KeyeConfigError(f"algorithm.tis_cap must be >= 1 (or null to disable), got {a.tis_cap}")
    if r.sync_bytes < 1:
        raise KeyeConfigError(f"rollout.sync_bytes must be >= 1, got {r.sync_bytes}")
    if cfg.rl.update == "streaming":
        if cfg.rl.mode != "async":
            raise KeyeConfigError("rl.update=streaming overlaps the update with generation: it needs rl.mode=async (the "
                                  "synchronous loop updates on whole batches)")
        if a.ppo_epochs != 1 or a.mini_batches != 1:
            raise KeyeConfigError(f"rl.update=streaming makes one optimizer step per batch: it needs "
                                  f"algorithm.ppo_epochs=1 and algorithm.mini_batches=1 (got {a.ppo_epochs}, "
                                  f"{a.mini_batches}); use rl.update=barrier or auto")


def _validate_autothink(cfg: RLEPConfig) -> None:
    """``algorithm.autothink`` checks: its own ranges, a synchronous loop (in process or on Ray), no
    ``mode_mix`` (the linked groups fix every prompt's modes), and a length penalty below the accuracy gap
    (a correct reply always beats a wrong one of the same format)."""
    from keye.rewards import RewardSpec

    at = cfg.algorithm.autothink
    at.check()
    if cfg.rl.engine == "ray" and cfg.rl.mode != "sync":
        # the synchronous Ray engine runs this module's loop (linked groups included) over Ray actors; the
        # asynchronous loop streams single answers through its trajectory manager and has no linked groups
        raise KeyeConfigError("algorithm.autothink runs with rl.engine=process or rl.engine=ray rl.mode=sync; the "
                              "asynchronous loop (rl.mode=async) does not build the linked auto / think / direct groups")
    if cfg.algorithm.mode_mix is not None:
        raise KeyeConfigError("algorithm.autothink sets every prompt's modes (auto + forced /think + /no_think "
                              "groups); set algorithm.mode_mix to null")
    if at.explore > cfg.rollout.G:
        raise KeyeConfigError(f"algorithm.autothink.explore ({at.explore}) must be <= rollout.G ({cfg.rollout.G}): "
                              "it is the number of auto replies per question whose decision is forced")
    spec = RewardSpec.from_dict(cfg.reward.spec)
    gap = spec.accuracy * (2.0 if spec.accuracy_pm1 else 1.0)
    if spec.accuracy > 0 and at.length_penalty >= gap:
        raise KeyeConfigError(f"algorithm.autothink.length_penalty ({at.length_penalty}) must be below the accuracy "
                              f"gap of reward.spec ({gap}), or a long correct reply could score below a wrong one")


def policy_loss_kwargs(cfg: RLEPConfig) -> dict[str, Any]:
    """Keyword arguments of :func:`keye.rl.algorithms.losses.policy_loss` from ``cfg.algorithm``; the Dr.GRPO factor
    defaults to ``rollout.max_new_tokens`` (the longest response, replayed ones are cut to it too), and in
    ``rl.mode: async`` the behaviour importance weight is truncated at :data:`DEFAULT_ASYNC_TIS_CAP` when
    ``algorithm.tis_cap`` is unset (the off-policy correction, :mod:`keye.rl.loop.streaming`)."""
    a = cfg.algorithm
    factor = a.loss_scale_factor if a.loss_scale_factor is not None else cfg.rollout.max_new_tokens
    tis_cap = a.tis_cap if a.tis_cap is not None or cfg.rl.mode != "async" else DEFAULT_ASYNC_TIS_CAP
    return dict(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, ratio_level=a.ratio_level,
                loss_agg=a.loss_agg, loss_scale_factor=float(factor), kl_coef=a.kl_coef,
                kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
                **({"tis_cap": tis_cap} if tis_cap is not None else {}))


def streaming_update(cfg: RLEPConfig) -> bool:
    """Whether the update streams (``rl.update``; ``auto``: in async mode when the update is one optimizer step)."""
    if cfg.rl.update != "auto":
        return cfg.rl.update == "streaming"
    return cfg.rl.mode == "async" and cfg.algorithm.ppo_epochs == 1 and cfg.algorithm.mini_batches == 1


def tree_enabled(cfg: RLEPConfig) -> bool:
    """Whether the shared-prefix path is used: ``tree.enabled``, or (None) when a group has >= 2 members."""
    if cfg.tree.enabled is not None:
        return cfg.tree.enabled
    m = cfg.replay.M if cfg.replay.enabled else 0
    return cfg.rollout.G + m >= 2



def replay_m(cfg: RLEPConfig) -> int:
    """Replayed answers appended per group: ``replay.M`` when replay is enabled, else 0 (plain GRPO)."""
    return cfg.replay.M if cfg.replay.enabled and cfg.replay.M > 0 else 0
