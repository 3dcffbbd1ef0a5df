"""RLEP / GRPO-family reinforcement learning of Keye-VL (the recipe behind ``keye train rlep``).

Launch::

    keye rlep collect --policy runs/tiny/final --data data/synth/train.jsonl --n 8 --out runs/pool.jsonl
    keye train rlep --config training/configs/tiny_synth_rlep.yaml                 # one CPU, minutes
    torchrun --nproc_per_node 8 -m keye train rlep --config training/configs/keye_vl_8b_rlep.yaml

One step (``keye.rl.update`` gives the core order; this module adds config, data parallelism,
optimizer, logging, evaluation and checkpoints):

1. draw ``data.prompts_per_step / world`` prompts on each rank (its own slice of a seeded per-epoch
   permutation), give them thinking modes (``algorithm.mode_mix``), sample ``rollout.G`` responses each
   (``algorithm.autothink``: each prompt becomes linked auto / forced-think / forced-direct groups and the auto
   replies get the mode-selection reward, :mod:`keye.rl.autothink`);
2. RLEP phase B: append ``replay.M`` replayed successes per group (missing ones as masked rows), score
   fresh and replayed responses with the same reward; with ``algorithm.dynamic_sampling`` groups whose
   accuracy (or total reward: ``dynamic_sampling_metric``) is all equal are dropped and refilled (at most
   ``max_rounds`` rounds);
3. online pool growth with new verified successes (gathered from every rank);
4. old (and reference) log-probs with the current policy - replayed responses included - through the
   shared-prefix tree (``tree.enabled``) or padded batches, then group-normalised advantages over the
   enlarged groups (+ optional difficulty reshaping by the fresh pass rate; with
   ``algorithm.kl_reward_coef`` the reward minus the k1 KL to the reference, summed over the response);
5. ``ppo_epochs`` x ``mini_batches`` optimizer updates on whole groups; every micro-batch loss is
   normalised by the token count of the whole mini-batch over all ranks, gradients are summed over
   ranks (data parallelism by explicit all-reduce: ranks may hold different numbers of live samples);
   a mini-batch without a loss token on any rank is skipped on every rank (no empty AdamW step).

All randomness of a step (sampling, replay draws, mode assignment, mini-batch order) is seeded from
``(train.seed, step, rank)``; a checkpoint stores the model, optimizer, scheduler, the prompt stream
cursors, the replay pool (entries + RNG) and the rollout generator states (a vLLM engine's seed
counter), so a resumed run reproduces the uninterrupted one exactly (on CPU). A vLLM engine holds its own
copy of the weights: it is synced after every update and, after a resume, before the first rollout.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from keye.errors import KeyeConfigError
from keye.rl import (
    DifficultyCurve,
    LocalRollout,
    ModeMix,
    ReplayPool,
    RewardScorer,
    RLPrompt,
    RolloutSample,
    VLLMRollout,
    add_replay,
    assign_advantages,
    autothink,
    collate_prompts,
    dynamic_sample,
    filter_prompts,
    load_rl_prompts,
    response_lengths,
    set_scores,
)
from keye.rl.autothink import AutoThinkConfig
from keye.rl.learner import reduce_sums
from keye.rl.losses import KL_LOSS_ESTIMATORS
from keye.rl.rollout import load_weight_shards
from keye.rl.sampling import group_signal
from keye.tiny import resolve_model_path
from keye.train import dist as kdist
from keye.train.config import dump_config, load_config, to_dict
from keye.train.sft import (
    MetricsWriter,
    ModelSection,
    list_checkpoints,
    prune_checkpoints,
)

log = logging.getLogger("keye.train.rlep")


# ----------------------------------------------------------------------------------------- config
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
    # (keye/rl/autothink.py, docs/autothink.md); in-process loop only
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
class RLTrainSection:
    """Optimisation (fields as in SFT's ``train`` section, ``steps`` = RL steps) and parallelism."""

    stage: Literal["align", "full", "llm_only", "custom"] = "full"
    freeze: list[str] = field(default_factory=list)
    lr: float = 1e-6
    lr_vision: float | None = None
    lr_projector: float | None = None
    lr_llm: float | None = None
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    schedule: Literal["cosine", "linear", "constant"] = "constant"
    min_lr_ratio: float = 0.1
    steps: int = 100  # RL steps (rollout batches)
    grad_clip: float = 1.0
    seed: int = 0
    # none / ddp: replicated policy; fsdp2 / zero3: sharded learner (keye/rl/learner.py)
    strategy: Literal["none", "ddp", "fsdp2", "zero3"] = "none"
    deepspeed_config: str | None = None  # zero3: a DeepSpeed JSON; default keye.rl.learner.DEFAULT_ZERO3
    device: str = "auto"


@dataclass
class RLCheckpointSection:
    """Where checkpoints go, how often, how many are kept, and the final export."""

    out_dir: str = "runs/rlep"
    save_every: int = 0
    keep_last: int = 2
    export: bool = True


@dataclass
class RLLogSection:
    """Metrics rows (every N steps), progress bar and TensorBoard."""

    every: int = 1
    progress: bool = True
    tensorboard: bool = False


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
    """Where the Ray components run (``rl.engine: ray``; keye/rl/ray_engine.py, docs/rl_ray.md)."""

    address: str | None = None  # None: start a local cluster with this machine's CPUs; "auto": join `ray start`
    num_cpus: int | None = None  # local cluster only: CPUs it offers (None: all of this machine's)
    learners: int = 1  # learner actors = ranks of one torch process group (train.strategy across them)
    rollout_workers: int = 1  # actors holding a whole-weight rollout engine (prompts split by index)
    reward_workers: int = 2  # actors scoring in parallel (0: score in the driver)
    reward_timeout_s: float = 60.0  # a reward call slower than this is killed and re-run on a new worker
    max_restarts: int = 3  # restarts of one worker within one call before the run fails
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
    checkpoint: RLCheckpointSection = field(default_factory=RLCheckpointSection)
    log: RLLogSection = field(default_factory=RLLogSection)
    eval: EvalSection = field(default_factory=EvalSection)
    rl: RLSection = field(default_factory=RLSection)


def validate(cfg: RLEPConfig, world_size: int = 1) -> None:
    """Cross-field checks; raises :class:`KeyeConfigError` naming the key."""
    a, r = cfg.algorithm, cfg.rollout
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


def _validate_autothink(cfg: RLEPConfig) -> None:
    """``algorithm.autothink`` checks: its own ranges, the in-process engine, no ``mode_mix`` (the linked groups
    fix every prompt's modes), and a length penalty below the accuracy gap (a correct reply always beats a
    wrong one of the same format)."""
    from keye.rewards import RewardSpec

    at = cfg.algorithm.autothink
    at.check()
    if cfg.rl.engine != "process":
        raise KeyeConfigError("algorithm.autothink needs rl.engine=process for now (the Ray loops do not build the "
                              "linked auto / think / direct groups)")
    if cfg.algorithm.mode_mix is not None:
        raise KeyeConfigError("algorithm.autothink sets every prompt's modes (auto + forced /think + /no_think "
                              "groups); set algorithm.mode_mix to null")
    spec = RewardSpec.from_dict(cfg.reward.spec)
    gap = spec.accuracy * (2.0 if spec.accuracy_pm1 else 1.0)
    if spec.accuracy > 0 and at.length_penalty >= gap:
        raise KeyeConfigError(f"algorithm.autothink.length_penalty ({at.length_penalty}) must be below the accuracy "
                              f"gap of reward.spec ({gap}), or a long correct reply could score below a wrong one")


def policy_loss_kwargs(cfg: RLEPConfig) -> dict[str, Any]:
    """Keyword arguments of :func:`keye.rl.losses.policy_loss` from ``cfg.algorithm``; the Dr.GRPO factor
    defaults to ``rollout.max_new_tokens`` (the longest response, replayed ones are cut to it too)."""
    a = cfg.algorithm
    factor = a.loss_scale_factor if a.loss_scale_factor is not None else cfg.rollout.max_new_tokens
    return dict(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip, ratio_level=a.ratio_level,
                loss_agg=a.loss_agg, loss_scale_factor=float(factor), kl_coef=a.kl_coef,
                kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
                **({"tis_cap": a.tis_cap} if a.tis_cap is not None else {}))


def tree_enabled(cfg: RLEPConfig) -> bool:
    """Whether the shared-prefix path is used: ``tree.enabled``, or (None) when a group has >= 2 members."""
    if cfg.tree.enabled is not None:
        return cfg.tree.enabled
    m = cfg.replay.M if cfg.replay.enabled else 0
    return cfg.rollout.G + m >= 2


# ------------------------------------------------------------------------------------ prompt stream
class PromptStream:
    """An endless stream of this rank's prompts: per epoch a permutation seeded by ``(seed, epoch)``
    (identity without ``shuffle``), rank ``r`` of ``w`` reads positions ``r, r + w, ...``."""

    def __init__(self, prompts: Sequence[RLPrompt], seed: int, rank: int, world: int, shuffle: bool):
        if len(prompts) < world:
            raise KeyeConfigError(f"{len(prompts)} RL prompts cannot feed {world} ranks")
        self.prompts, self.seed, self.rank, self.world, self.shuffle = list(prompts), seed, rank, world, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        idx = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(idx)
        return idx[self.rank :: self.world]

    def draw(self, k: int) -> list[RLPrompt]:
        """The next ``k`` prompts (rolling into the next epoch)."""
        out = []
        while len(out) < k:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._epoch_order()
            out.append(self.prompts[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """Cursor (epoch, position)."""
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._epoch_order()


class RunState:
    """What a checkpoint holds besides model/optimizer/scheduler (passed as the SFT ``loader``):
    every rank's prompt cursor and rollout generator state, and the (rank-identical) replay pool.

    :meth:`snapshot` is collective (call it on every rank before saving); :meth:`state_dict` returns it.
    """

    def __init__(self, stream: PromptStream, pool: ReplayPool, engine: Any, rank: int):
        self.stream, self.pool, self.engine, self.rank = stream, pool, engine, rank
        self._snap: dict[str, Any] | None = None

    def snapshot(self) -> None:
        """Gather the per-rank pieces (collective)."""
        mine = {"stream": self.stream.state_dict(),
                "engine": self.engine.state_dict() if hasattr(self.engine, "state_dict") else None}
        ranks = _all_gather(mine)
        self._snap = {"ranks": ranks, "pool": self.pool.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        """The last :meth:`snapshot`."""
        if self._snap is None:
            raise KeyeConfigError("RunState.snapshot() must run on every rank before saving")
        return self._snap

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's cursor and generator and the pool."""
        ranks = state["ranks"]
        if len(ranks) != self.stream.world:
            raise KeyeConfigError(f"checkpoint was written by {len(ranks)} ranks; resume with the same world size "
                                  f"(now {self.stream.world})")
        self.stream.load_state_dict(ranks[self.rank]["stream"])
        if ranks[self.rank]["engine"] is not None and hasattr(self.engine, "load_state_dict"):
            self.engine.load_state_dict(ranks[self.rank]["engine"])
        self.pool.load_state_dict(state["pool"])


def _all_gather(obj: Any) -> list[Any]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _dynsample_stats(res: Any, device: torch.device) -> dict[str, float]:
    """All-rank dynamic-sampling metrics (collective): groups generated and dropped summed over ranks, the
    kept fraction of those sums, and the rounds of the slowest rank."""
    g = reduce_sums({"generated": float(res.generated), "dropped": float(res.dropped)}, device)
    rounds = max(_all_gather(int(res.rounds)))
    kept = (g["generated"] - g["dropped"]) / g["generated"] if g["generated"] else 0.0
    return {"dynsample/rounds": float(rounds), "dynsample/generated": g["generated"],
            "dynsample/dropped": g["dropped"], "dynsample/kept_frac": kept}


def _step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**62)


# ---------------------------------------------------------------------------------------- eval
@torch.no_grad()
def greedy_accuracy(model: Any, processor: Any, prompts: Sequence[RLPrompt], scorer: RewardScorer, *,
                    max_new_tokens: int, batch_size: int, samples: int = 0, temperature: float = 1.0,
                    seed: int = 0, per_prompt: bool = False) -> dict[str, Any]:
    """Held-out accuracy: answers scored by the reward's accuracy part (``passed``).

    With ``samples == 0`` one greedy answer per prompt (the official protocol). With ``samples = k > 0``
    also ``k`` answers per prompt sampled at ``temperature`` (top-p 1, top-k 0: the policy's own
    distribution, as in the rollouts), reported as ``sampled_accuracy`` = the mean over all ``k * n``
    answers (avg@k, the quantity RL maximises). Sampling draws from a private generator seeded with
    ``seed``, so every evaluation of a run uses the same random numbers (curves compare checkpoints, not
    draws) and the training RNG stream is untouched.

    Returns ``{"accuracy": fraction in [0, 1], "n": number of prompts}`` plus ``sampled_accuracy`` and
    ``samples`` when ``samples > 0``, and with ``per_prompt`` a ``per_prompt`` mapping of prompt id to
    ``[greedy passed (0/1), sampled answers passed, answers sampled]`` (for paired comparisons).
    """
    from keye.processing.chat import apply_mode
    from keye.rl.logprobs import model_inputs as vision_inputs
    from keye.rl.rollout import split_batch

    was_training = model.training
    model.eval()
    eos = list(model.config.eos_token_ids)
    pad = int(processor.pad_token_id)
    gen_rng = torch.Generator(device=model.device).manual_seed(seed)

    table: dict[str, list[int]] = {p.id: [0, 0, 0] for p in prompts}

    def answer(chunk: list[RLPrompt], sample: bool) -> int:
        batch = processor([apply_mode(p.messages, p.mode) for p in chunk], return_tensors="pt")
        inputs = split_batch(batch, processor.image_token_id, processor.video_token_id,
                             processor.image_processor.config.merge_size)
        gen = collate_prompts(inputs, pad)
        kw: dict[str, Any] = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                                  generator=gen_rng) if sample else dict(do_sample=False)
        seqs = model.generate(gen["input_ids"].to(model.device), gen["attention_mask"].to(model.device),
                              max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **kw,
                              **vision_inputs(gen, model.device, model.dtype))
        new = seqs[:, gen["input_ids"].shape[1] :].cpu()
        lengths = response_lengths(new, eos)
        rows = [RolloutSample(prompt=p, group=j, inputs=inp, response_ids=row[:k].clone(),
                              text=processor.decode(row[:k], skip_special_tokens=True), finished=True)
                for j, (p, inp, row, k) in enumerate(zip(chunk, inputs, new, lengths.tolist()))]
        passed = [bool(x) for x in scorer(rows).passed]
        for p, ok in zip(chunk, passed):
            if sample:
                table[p.id][1] += ok
                table[p.id][2] += 1
            else:
                table[p.id][0] = int(ok)
        return sum(passed)

    correct = sampled = 0
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i : i + batch_size])
            correct += answer(chunk, sample=False)
            if samples > 0:  # each prompt repeated k times: the chunk's k * len(chunk) answers in one batch
                sampled += answer([p for p in chunk for _ in range(samples)], sample=True)
    finally:
        model.train(was_training)
    n = max(len(prompts), 1)
    res: dict[str, Any] = {"accuracy": correct / n, "n": float(len(prompts))}
    if samples > 0:
        res.update(sampled_accuracy=sampled / (n * samples), samples=float(samples))
    if per_prompt:
        res["per_prompt"] = table
    return res


# ------------------------------------------------------------------------------------------ main
def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def train(cfg: RLEPConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run the RL recipe as configured; returns the run summary (also written to ``summary.json``).

    ``stop_after`` stops after that many RL steps *of this invocation* without the final save (simulates a
    crash in resume tests). The summary holds per-step ``losses`` (mean over the step's optimizer updates),
    ``rewards`` (mean fresh reward), ``pass_rates`` and the ``eval_curve``. With ``rl.engine=ray
    rl.mode=async`` the asynchronous loop runs instead (:func:`keye.rl.async_loop.train_async`).
    """
    if cfg.rl.engine == "ray" and cfg.rl.mode == "async":
        from keye.rl.async_loop import train_async

        return train_async(cfg, stop_after=stop_after)
    from keye.processing.processor import KeyeProcessor
    from keye.rewards import RewardSpec

    info = kdist.init_distributed(cfg.train.device)
    validate(cfg, info.world_size)
    out_dir = Path(cfg.checkpoint.out_dir)
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out_dir / "config.yaml")
    kdist.barrier()
    random.seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)

    model_path = resolve_model_path(cfg.model.path)
    processor = KeyeProcessor.from_pretrained(resolve_model_path(cfg.model.processor or cfg.model.path))
    parts = build_components(cfg, info, model_path, processor)
    learner, engine, rollout_model, eval_model = parts.learner, parts.engine, parts.rollout_model, parts.eval_model
    frozen = learner.frozen
    r = cfg.rollout
    spec = RewardSpec.from_dict(cfg.reward.spec)
    scorer = parts.scorer if parts.scorer is not None else RewardScorer(spec, pass_value=cfg.reward.pass_value)
    eos_id = int(learner.config.eos_token_ids[0])
    pad_id = int(processor.pad_token_id)

    def encode(text: str) -> list[int]:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(ids: list[int]) -> str:  # as the rollouts decode their responses
        return processor.decode(ids, skip_special_tokens=True)

    replay_on = cfg.replay.enabled and cfg.replay.M > 0
    m_replay = cfg.replay.M if replay_on else 0
    if replay_on and cfg.replay.pool:
        pool = ReplayPool.load_jsonl(cfg.replay.pool, max_per_question=cfg.replay.max_per_question,
                                     overflow=cfg.replay.overflow, seed=cfg.train.seed)
    else:
        pool = ReplayPool(cfg.replay.max_per_question, cfg.replay.overflow, seed=cfg.train.seed)

    prompts = load_rl_prompts(cfg.data.manifest)
    if cfg.data.limit is not None:
        prompts = prompts[: cfg.data.limit]
    if not prompts:
        raise KeyeConfigError(f"{cfg.data.manifest}: no RL prompts")
    eval_prompts: list[RLPrompt] = []
    if cfg.eval.manifest:
        eval_prompts = load_rl_prompts(cfg.eval.manifest)[: cfg.eval.limit]
    # held-out accuracy = the reward's accuracy part alone (same answer checking options as training)
    eval_scorer = RewardScorer(RewardSpec.from_dict({"rewards": ["accuracy"], "options": _reward_options(cfg.reward.spec)}),
                               pass_value=cfg.reward.pass_value)

    state: dict[str, Any] = {"step": 0, "losses": [], "rewards": [], "pass_rates": [], "eval_curve": [],
                             "prompt_ids": None, "tokens": 0}
    ckpts = list_checkpoints(out_dir)
    resume_blob = None
    if ckpts:
        resume_blob = torch.load(ckpts[-1] / "trainer_state.pt", weights_only=False)["trainer"]
    if resume_blob is not None and resume_blob.get("prompt_ids") is not None:
        keep = set(resume_blob["prompt_ids"])
        prompts = [p for p in prompts if p.id in keep]
    elif cfg.data.filter_samples > 0:
        prompts = _filter(prompts, engine, scorer, cfg, info)
        if not prompts:
            raise KeyeConfigError("prompt filtering kept no prompt (every accuracy was 0 or 1)")
    state["prompt_ids"] = [p.id for p in prompts] if cfg.data.filter_samples > 0 else None
    stream = PromptStream(prompts, cfg.train.seed, info.rank, info.world_size, cfg.data.shuffle)
    run_state = RunState(stream, pool, engine, info.rank)
    if ckpts:
        state = learner.load_checkpoint(ckpts[-1], run_state)
        if info.is_main:
            log.info("resumed from %s at step %d", ckpts[-1], state["step"])

    def sync_engine(version: int) -> None:
        """Send the learner's weights to an engine that holds its own copy (shard by shard, collective)."""
        if hasattr(engine, "sync_from"):  # an engine that pulls them itself (keye.rl.ray_engine)
            engine.sync_from(learner, version)
        elif isinstance(engine, VLLMRollout):
            engine.sync_weights(learner.export_weights(r.sync_bytes), version=version)
        elif rollout_model is not learner.model:
            engine.load_weights(learner.export_weights(r.sync_bytes), version=version)

    if getattr(engine, "weight_version", state["step"]) != state["step"]:
        # the engine was built from the start checkpoint: after a resume it must serve the resumed policy
        # before the first rollout (it is synced after every update from then on)
        sync_engine(state["step"])

    metrics = MetricsWriter(out_dir, info.is_main, cfg.log.tensorboard)
    bar = None
    if info.is_main and cfg.log.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.train.steps, initial=state["step"], desc="rlep" if m_replay else "grpo", dynamic_ncols=True)
    use_tree = tree_enabled(cfg)
    a = cfg.algorithm
    mix = ModeMix.from_config(a.mode_mix)
    at = a.autothink
    at_scale = at.length_scale if at.length_scale is not None else r.max_new_tokens
    at_log = autothink.GroupLog(out_dir, state["step"], enabled=at.enabled and at.record and info.is_main)
    loss_kwargs = policy_loss_kwargs(cfg)
    per_rank = cfg.data.prompts_per_step // info.world_size

    def evaluate(step: int) -> None:
        if not eval_prompts:
            return
        if rollout_model is None:  # collective: every rank walks the shards, the main rank loads them
            shards = learner.export_weights(r.sync_bytes)
            if info.is_main:
                load_weight_shards(eval_model, shards)
            else:
                for _ in shards:
                    pass
        if info.is_main:
            res = greedy_accuracy(eval_model, processor, eval_prompts, eval_scorer, max_new_tokens=cfg.eval.max_new_tokens,
                                  batch_size=cfg.eval.batch_size, samples=cfg.eval.samples,
                                  temperature=cfg.eval.temperature, seed=cfg.train.seed)
            state["eval_curve"].append({"step": step, **res})
            metrics.write(step, {f"eval/{k}": v for k, v in res.items()})
            (out_dir / "eval_curve.json").write_text(json.dumps(state["eval_curve"], indent=2))
        state["eval_curve"] = kdist.broadcast_object(state["eval_curve"])

    def save(step: int) -> None:
        run_state.snapshot()
        learner.save_checkpoint(out_dir / f"step_{step:08d}", run_state, state, processor)
        if info.is_main:
            prune_checkpoints(out_dir, cfg.checkpoint.keep_last)

    if state["step"] == 0 and not state["eval_curve"]:
        evaluate(0)
    t_start = time.time()
    steps_this_run = 0
    while state["step"] < cfg.train.steps:
        step = state["step"] + 1
        seed = _step_seed(cfg.train.seed, step, info.rank)
        if hasattr(engine, "reseed"):
            engine.reseed(seed)
        replay_rng = random.Random(seed)
        mode_rng = random.Random(seed + 1)
        t0 = time.time()
        timing = {"rollout": 0.0, "score": 0.0}

        def produce(batch_prompts: Sequence[RLPrompt], mode_rng: random.Random = mode_rng,
                    replay_rng: random.Random = replay_rng, timing: dict[str, float] = timing,
                    ) -> list[list[RolloutSample]]:
            ps = mix.assign(batch_prompts, mode_rng) if mix is not None else list(batch_prompts)
            t = time.time()
            fresh = autothink.generate(engine, ps, r.G, at) if at.enabled else engine.generate(ps, r.G)
            samples = add_replay(fresh, pool, m_replay, encode=encode, eos_id=eos_id, max_response_len=r.max_new_tokens,
                                 rng=replay_rng, match_mode=cfg.replay.match_mode, decode=decode) if m_replay else fresh
            timing["rollout"] += time.time() - t
            t = time.time()
            scores = scorer(samples)
            set_scores(samples, scores)
            for s, parts in zip(samples, scores.parts):
                s.metadata["reward_parts"] = parts
            timing["score"] += time.time() - t
            if at.enabled:  # one linked list (auto, think, direct groups) per prompt, auto replies re-rewarded
                return autothink.link_groups(samples, len(ps), at, at_scale)
            groups: dict[int, list[RolloutSample]] = {}
            for s in samples:
                groups.setdefault(s.group, []).append(s)
            return [groups[i] for i in range(len(ps))]

        if a.dynamic_sampling:
            res = dynamic_sample(stream.draw, produce, per_rank,
                                 rewards_of=(lambda g: autothink.group_signal(g, a.dynamic_sampling_metric,
                                                                              at.train_forced)) if at.enabled else
                                 (lambda g: group_signal(g, a.dynamic_sampling_metric)),
                                 max_rounds=a.max_rounds, oversample=a.oversample)
            groups, ds_stats = res.groups, _dynsample_stats(res, info.device)
        else:
            groups, ds_stats = produce(stream.draw(per_rank)), {}
        at_row: dict[str, float] = {}
        if at.enabled:  # measure and record the linked questions, then train their (trained) groups
            at_row = autothink.finish_metrics(reduce_sums(autothink.metric_sums(groups), info.device))
            if at.record:
                at_log.write([q for rows in _all_gather(autothink.question_records(groups, step)) for q in rows])
            samples, n_groups = autothink.flatten(groups, at.train_forced)
        else:
            samples, n_groups = [], len(groups)
            for gi, g in enumerate(groups):
                for s in g:
                    s.group = gi
                    samples.append(s)
        fresh = [s for s in samples if s.source == "rollout"]
        pool_added = 0
        if replay_on and cfg.replay.online:
            mine = [(s.prompt.id, s.prompt.mode, s.text, [int(t) for t in s.response_ids], float(s.reward))
                    for s in fresh if s.passed]
            for rows in _all_gather(mine):
                pool_added += _add_online(pool, rows, step)

        t = time.time()
        learner.compute_logprobs(samples, pad_id=pad_id, use_tree=use_tree)
        if learner.ref_model is not None:
            learner.compute_logprobs(samples, target="ref_logp", pad_id=pad_id, use_tree=use_tree)
        timing["old_logprob"] = time.time() - t
        if samples:  # after the log-probs: the KL reward penalty uses them
            assign_advantages(samples, std=a.std, eps=a.eps, difficulty=a.difficulty, kl_reward_coef=a.kl_reward_coef)

        t = time.time()
        res_update = learner.update(samples, n_groups=n_groups, seed=seed, pad_id=pad_id, use_tree=use_tree,
                                    loss_kwargs=loss_kwargs)
        update_stats, grad_norms, skipped, lr_used = (res_update.stats, res_update.grad_norms, res_update.skipped,
                                                      res_update.lr)
        sync_engine(step)  # the next rollouts sample the updated policy
        timing["update"] = time.time() - t

        row = _step_metrics(samples, update_stats, info.device, tis=a.tis_cap is not None)
        row.update({f"time/{k}": v for k, v in timing.items()})
        row.update(ds_stats)
        row.update(at_row)
        row.update(pool.stats())
        row["pool/added"] = float(pool_added)
        row["grad_norm"] = _mean(grad_norms)
        row["updates_skipped"] = float(skipped)
        row["lr"] = lr_used
        dt = time.time() - t0
        step_tokens = row.pop("_tokens")
        row["tokens_per_s"] = step_tokens / max(dt, 1e-9)
        state["step"] = step
        state["tokens"] += int(step_tokens)
        state["losses"].append(row["loss"])
        state["rewards"].append(row["reward/mean"])
        state["pass_rates"].append(row["pass_rate"])
        steps_this_run += 1
        if step % cfg.log.every == 0:
            metrics.write(step, row)
        if bar is not None:
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}", pass_=f"{row['pass_rate']:.2f}",
                            replay=f"{row['replay_share']:.2f}", clip=f"{row['clip_frac']:.3f}",
                            kl=f"{row.get('kl', row['approx_kl']):.4f}", ent=f"{row['entropy']:.2f}",
                            len=f"{row['response_length']:.1f}", tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1)
        if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
            evaluate(step)
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < cfg.train.steps:
            save(step)
        if stop_after is not None and steps_this_run >= stop_after and step < cfg.train.steps:
            break
    if bar is not None:
        bar.close()
    finished = state["step"] >= cfg.train.steps
    if finished:
        evaluate(state["step"])
        save(state["step"])
        if info.is_main:
            if cfg.checkpoint.export:
                final = out_dir / "final"
                shutil.rmtree(final, ignore_errors=True)
                shutil.copytree(out_dir / f"step_{state['step']:08d}" / "model", final)
            if replay_on:
                pool.save_jsonl(out_dir / "pool.jsonl")
    summary = {
        "finished": finished,
        "steps": state["step"],
        "losses": state["losses"],
        "rewards": state["rewards"],
        "pass_rates": state["pass_rates"],
        "eval_curve": state["eval_curve"],
        "tokens": state["tokens"],
        "seconds": time.time() - t_start,
        "tree": use_tree,
        "replay_M": m_replay,
        "pool": pool.stats(),
        "frozen_towers": frozen,
        "world_size": info.world_size,
        "strategy": learner.strategy,
        "prompts": len(prompts),
        # identical on every rank when the replicas stayed in sync (data-parallel sanity check)
        "param_checksum": learner.checksum(),
    }
    if info.is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        metrics.close()
        if cfg.log.progress:
            print(format_summary(summary, out_dir))
    kdist.barrier()
    return summary


@dataclass
class Components:
    """What one RL run is made of: the learner, the rollout engine, and the whole-weight models sampling and
    evaluation run on (``rollout_model`` is the learner's own model when it is replicated, a synced inference
    copy under a sharded learner, None when the engine holds its own weights; ``eval_model`` the model the
    main rank evaluates with, None elsewhere)."""

    learner: Any
    engine: Any
    rollout_model: Any
    eval_model: Any
    scorer: Any = None  # what scores samples (None: a RewardScorer in this process)


def build_components(cfg: RLEPConfig, info: kdist.DistInfo, model_path: Path, processor: Any) -> Components:
    """The learner and rollout engine of ``cfg`` (``rollout.engine`` local / vllm, ``train.strategy``); with
    ``rl.engine: ray`` the Ray actors of :mod:`keye.rl.ray_engine` (Ray is imported only then)."""
    if cfg.rl.engine == "ray":
        from keye.rl.ray_engine import build_ray_components

        return build_ray_components(cfg, info, model_path, processor)
    if cfg.rl.mode != "sync":
        raise KeyeConfigError(f"rl.mode={cfg.rl.mode} needs rl.engine=ray (the in-process loop is synchronous)")
    from keye.model.keye_vl import KeyeVL
    from keye.rl.learner import Learner

    learner = Learner(cfg, info, model_path=model_path)

    def whole_copy() -> Any:
        m = KeyeVL.from_pretrained(model_path, torch_dtype=learner.dtype,
                                   attn_implementation=cfg.model.attn_implementation)
        return m.to(info.device).eval().requires_grad_(False)

    # the policy that samples: the learner's own replicated model, or (sharded learner, local engine) a whole
    # inference copy on every rank that receives the learner's weights after each update, as vLLM would
    r = cfg.rollout
    seed = _step_seed(cfg.train.seed, 0, info.rank)
    if r.engine == "local":
        rollout_model = whole_copy() if learner.sharded else learner.model
        engine: Any = LocalRollout(rollout_model, processor, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                   top_p=r.top_p, top_k=r.top_k, max_batch_size=r.max_batch_size, seed=seed)
    else:
        rollout_model = None if learner.sharded else learner.model
        engine = VLLMRollout(model_path, processor, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                             top_p=r.top_p, top_k=r.top_k, seed=seed, colocate=r.colocate)
    # held-out evaluation generates on the main rank alone, so it needs whole weights: the rollout model, or
    # (sharded learner + vLLM) a main-rank copy refreshed from the exported shards before each evaluation
    eval_model = rollout_model
    if rollout_model is None:
        eval_model = whole_copy() if info.is_main and cfg.eval.manifest else None
    return Components(learner, engine, rollout_model, eval_model)


def _reward_options(spec: dict[str, Any]) -> dict[str, Any]:
    """The options of a reward config mapping (those that tune the accuracy check are reused for eval)."""
    opts = dict(spec.get("options") or {})
    opts.update({k: v for k, v in spec.items() if k not in ("rewards", "options")})
    return opts


def _add_online(pool: ReplayPool, rows: list[tuple], step: int) -> int:
    from keye.rl import ReplayEntry

    added = 0
    for qid, mode, text, ids, reward in rows:
        added += pool.add(ReplayEntry(qid, text, ids, reward, {"mode": mode, "source": "online", "step": step}))
    return added


def _filter(prompts: list[RLPrompt], engine: Any, scorer: RewardScorer, cfg: RLEPConfig, info: Any) -> list[RLPrompt]:
    """Pre-run prompt filtering to sampling accuracy in (0, 1); each rank tests its slice, ids are gathered."""
    mine = prompts[info.rank :: info.world_size]
    res = filter_prompts(mine, engine, scorer, cfg.data.filter_samples, batch_prompts=max(1, cfg.data.prompts_per_step))
    keep = {pid for ids in _all_gather([p.id for p in res.kept]) for pid in ids}
    return [p for p in prompts if p.id in keep]


def _step_metrics(samples: Sequence[RolloutSample], update_stats: list[dict[str, float]],
                  device: torch.device, tis: bool = False) -> dict[str, float]:
    """Global (all-rank) step metrics: reward mean and per part, pass rate, replay share, response
    length of the fresh rollouts, and update stats: per update the mean over every rank's loss tokens
    (each rank's stats weighted by its ``local_tokens``, so a rank without tokens adds nothing), then the
    mean over the step's updates (every rank holds the same updates in the same order). ``tis``: also the
    truncated importance-sampling statistics (``algorithm.tis_cap`` set)."""
    fresh = [s for s in samples if s.source == "rollout"]
    valid = [s for s in samples if s.valid]
    sums: dict[str, float] = {
        "n_fresh": float(len(fresh)), "n_valid": float(len(valid)),
        "reward": sum(float(s.reward) for s in fresh), "passed": float(sum(bool(s.passed) for s in fresh)),
        "replay": float(sum(s.source == "replay" for s in valid)),
        "length": float(sum(s.num_tokens for s in fresh)),
        "tokens": float(sum(s.num_tokens + s.inputs.length for s in valid)),
        "replay_reward": sum(float(s.reward) for s in valid if s.source == "replay"),
        "adv_abs": sum(abs(float(s.advantage or 0.0)) for s in valid),
    }
    part_names = ("format", "accuracy", "json", "code", "markdown", "steps", "length", "repetition", "overlong")
    for name in part_names:
        vals = [s.metadata.get("reward_parts", {}).get(name) for s in fresh]
        vals = [v for v in vals if v is not None]
        sums[f"part/{name}"] = float(sum(vals))
        sums[f"part_n/{name}"] = float(len(vals))
    stat_keys = ("clip_frac", "clip_frac_high", "clip_frac_low", "dual_clip_frac", "approx_kl", "entropy", "kl",
                 "ratio_mean")
    if tis:
        stat_keys += ("tis_weight_mean", "tis_clip_frac", "rollout_logp_abs_diff")
    n_upd = float(len(update_stats))
    for i, st in enumerate(update_stats):
        w = st["local_tokens"]
        sums[f"stat_w/{i}"] = w
        for k in stat_keys:
            sums[f"stat/{k}/{i}"] = st.get(k, 0.0) * w
    sums["stat/has_kl"] = float(any("kl" in st for st in update_stats))
    g = reduce_sums(sums, device)
    # every rank runs the same number of updates; the global loss of an update is the sum of the rank shares
    losses = [st.get("loss", 0.0) for st in update_stats]
    loss_sum = reduce_sums({"loss": sum(losses)}, device)["loss"]
    row = {
        "loss": loss_sum / max(n_upd, 1.0),
        "reward/mean": g["reward"] / max(g["n_fresh"], 1.0),
        "pass_rate": g["passed"] / max(g["n_fresh"], 1.0),
        "replay_share": g["replay"] / max(g["n_valid"], 1.0),
        "replay_reward": g["replay_reward"] / max(g["replay"], 1.0),
        "response_length": g["length"] / max(g["n_fresh"], 1.0),
        "adv_abs_mean": g["adv_abs"] / max(g["n_valid"], 1.0),
        "_tokens": g["tokens"],
    }
    for name in part_names:
        if g[f"part_n/{name}"]:
            row[f"reward/{name}"] = g[f"part/{name}"] / g[f"part_n/{name}"]
    for k in stat_keys:
        if k == "kl" and not g["stat/has_kl"]:
            continue
        per_update = [g[f"stat/{k}/{i}"] / g[f"stat_w/{i}"] for i in range(len(update_stats)) if g[f"stat_w/{i}"]]
        row[k] = _mean(per_update)
    return row


def format_summary(s: dict[str, Any], out_dir: Path) -> str:
    """A human-readable end-of-run report."""
    curve = s["eval_curve"]
    ev = "" if not curve else f", held-out accuracy {curve[0]['accuracy']:.3f} -> {curve[-1]['accuracy']:.3f}"
    rew = "n/a" if not s["rewards"] else f"{s['rewards'][0]:.3f} -> {s['rewards'][-1]:.3f}"
    return (f"{'RLEP' if s['replay_M'] else 'GRPO'} {'finished' if s['finished'] else 'stopped'}: {s['steps']} steps, "
            f"reward {rew}{ev}, tree={s['tree']}, {s['seconds']:.1f}s on {s['world_size']} process(es); "
            f"outputs in {out_dir}")


def main(argv: list[str] | None = None) -> int:
    """``keye train rlep --config CFG.yaml [key=value ...]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="keye train rlep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML recipe config")
    ap.add_argument("overrides", nargs="*", help="dot-list overrides, e.g. replay.M=0 train.steps=20")
    args = ap.parse_args(argv)
    return run_from_args(args.config, args.overrides)


def run_from_args(config: str | None, overrides: list[str]) -> int:
    """Load the config (YAML + overrides), run, tear the process group down."""
    logging.basicConfig(level=os.environ.get("KEYE_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(RLEPConfig, config, overrides)
    try:
        train(cfg)
    finally:
        kdist.cleanup()
    return 0


__all__ = ["RLEPConfig", "PromptStream", "RunState", "greedy_accuracy", "main", "to_dict", "train", "tree_enabled",
           "validate"]
