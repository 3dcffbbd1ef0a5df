"""The learner: the policy side of RL, replicated or sharded, behind one small interface.

::

    learner = Learner.from_config(cfg, info, model_path=path)  # policy (+ reference), optimizer, scheduler
    learner.compute_logprobs(samples)                       # sample.old_logp (the current policy)
    learner.compute_logprobs(samples, target="ref_logp")    # sample.ref_logp (the reference model)
    result = learner.update(samples, seed=step_seed)        # ppo_epochs x mini_batches optimizer updates
    for shard in learner.export_weights():                  # every rank; name -> full tensor, bounded size
        engine.load_weights(shard)

``train.strategy`` picks the layout (training.md §8: the losses and their normalisation do not depend on it):

* ``none`` / ``ddp``: every rank holds the whole policy; gradients are summed over ranks by an explicit
  all-reduce (ranks may hold different numbers of live samples).
* ``fsdp2``: decoder layers, vision layers and the root are sharded with ``torch.distributed.fsdp``
  (parameters, gradients and AdamW moments are 1/world per rank); the reference model is sharded the
  same way (``algorithm.reference_placement: sharded``) or kept whole on the CPU (``cpu``).
* ``zero3``: DeepSpeed ZeRO-3 (``train.deepspeed_config``, default :data:`DEFAULT_ZERO3`), the
  reference model as a ZeRO-3 inference engine or on the CPU.

Sharded layouts gather every layer's weights collectively inside each forward, so all ranks must run the
same number of forwards (and backwards) in the same order, whatever their share of the batch: the learner
pads each rank's list of micro-batches with a one-token dummy whose loss is multiplied by zero, and the
vision tower runs on every forward (``always_run_vision``). Per-token log-probs are computed inside the
model's forward (:class:`keye.train.logprobs.LogprobRequest`), where the sharded ``lm_head`` is gathered.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from keye.errors import KeyeConfigError
from keye.rl.algorithms.losses import policy_loss
from keye.rl.algorithms.sampling import group_minibatches
from keye.rl.algorithms.update import assign_advantages
from keye.rl.rollout.samples import RolloutSample, collate_samples
from keye.rl.rollout.settings import SamplingSettings
from keye.train import dist as kdist
from keye.train.logprobs import DEFAULT_CHUNK_TOKENS, LogprobRequest, token_logprobs
from keye.train.models import load_inference_model, resolve_dtype
from keye.train.optim import apply_freezing, build_optimizer, build_scheduler

log = logging.getLogger("keye.rl.learner")

SHARDED = ("fsdp2", "zero3")
STRATEGIES = ("none", "ddp", "fsdp2", "zero3")
DEFAULT_EXPORT_BYTES = 512 * 2**20
"""Largest weight shard :meth:`Learner.export_weights` assembles (one tensor larger than this is its own
shard): the rollout side receives the model in pieces this size, never whole."""


DEFAULT_ZERO3 = {
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "stage3_gather_16bit_weights_on_model_save": True,
                          "stage3_param_persistence_threshold": 10000, "reduce_bucket_size": 200_000_000},
    "bf16": {"enabled": "auto"},
    "steps_per_print": 1_000_000,
    "wall_clock_breakdown": False,
}
"""The ZeRO-3 settings used without ``train.deepspeed_config`` (those of ``training/deepspeed/zero3.json``)."""


# ------------------------------------------------------------------------------------ helpers
def placeholder_ids(core: Any) -> list[int]:
    """The model's image / video placeholder token ids (kept out of every RL loss)."""
    return [int(getattr(core.config, k)) for k in ("image_token_id", "video_token_id")
            if getattr(core.config, k, None) is not None]


def loss_token_count(samples: Sequence[RolloutSample], placeholders: list[int]) -> int:
    """Tokens of ``samples`` that enter the loss (response tokens minus sampled vision placeholder ids)."""
    excl = torch.tensor(placeholders, dtype=torch.long)
    return sum(int((~torch.isin(s.response_ids[: s.num_tokens], excl)).sum()) for s in samples if s.num_tokens > 0)


def tree_ok(group: Sequence[RolloutSample], placeholders: list[int]) -> bool:
    """A group can share its prompt in a tree unless a response sampled a vision placeholder id (those decode
    as text, which the tree's vision bookkeeping cannot express; such groups take the padded path)."""
    ph = torch.tensor(placeholders, dtype=torch.long)
    return not any(bool(torch.isin(s.response_ids, ph).any()) for s in group)


def group_rows(samples: Sequence[RolloutSample]) -> list[list[RolloutSample]]:
    """Live samples (with tokens) grouped by ``group``, groups in order of first appearance."""
    groups: dict[int, list[RolloutSample]] = {}
    for s in samples:
        if s.num_tokens > 0:
            groups.setdefault(s.group, []).append(s)
    return list(groups.values())


def average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Replicated data parallelism: sum every trainable gradient over ranks and divide by the world size.

    A gradient missing on some ranks counts as zeros there, so every rank applies the same update; one
    missing on every rank stays None (as in one process and in DDP: AdamW then leaves the parameter, its
    moments and its weight decay alone instead of stepping on a zero gradient)."""
    if world == 1 or not params:
        return
    has = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    torch.distributed.all_reduce(has)
    params = [p for p, n in zip(params, has.tolist()) if n > 0]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    torch.distributed.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def tree_forward(core: Any, groups: Sequence[Sequence[RolloutSample]], *, temperature: float, kernel: str,
                 entropy: bool, call: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Log-probs of every response of ``groups`` from one forest forward (each prompt computed once).

    ``call`` is what runs the forward when it is not ``core`` itself (a DeepSpeed engine: its forward
    registers the hooks its backward needs). Returns logp float32 [B, T], mask bool [B, T] and entropy
    [B, T] (or None); rows follow the groups' samples in order.
    """
    from keye.train.tree import VisionInputs, build_group_tree, concat_trees, tree_logprobs

    dtype = core.lm_head.weight.dtype
    trees = []
    for g in groups:
        inp = g[0].inputs
        vis = VisionInputs(
            pixel_values=None if inp.pixel_values is None else inp.pixel_values.to(dtype),
            image_grid_thw=inp.image_grid_thw,
            pixel_values_videos=None if inp.pixel_values_videos is None else inp.pixel_values_videos.to(dtype),
            video_grid_thw=inp.video_grid_thw, second_per_grid_ts=inp.second_per_grid_ts,
        )
        trees.append(build_group_tree(core.config, inp.input_ids, [s.response_ids for s in g], vis))
    out = tree_logprobs(core if call is None else call, concat_trees(trees), kernel=kernel, temperature=temperature,
                        entropy=entropy)
    return out[0], out[1], (out[2] if entropy else None)


@dataclass
class MicroBatch:
    """One forward of the learner: ``tree`` (whole groups sharing their prompts) or ``padded`` rows.
    ``samples`` are in the row order of the forward's output."""

    kind: str
    samples: list[RolloutSample]
    groups: list[list[RolloutSample]] = field(default_factory=list)

    @property
    def has_vision(self) -> bool:
        """Whether any row carries pixels (the vision tower gets real gradients)."""
        return any(s.inputs.pixel_values is not None or s.inputs.pixel_values_videos is not None
                   for s in self.samples)


def plan_micro_batches(samples: Sequence[RolloutSample], *, use_tree: bool, placeholders: list[int],
                       groups_per_micro_batch: int, micro_batch_size: int) -> list[MicroBatch]:
    """Split live samples into forwards: shared-prefix trees of ``groups_per_micro_batch`` whole groups (groups
    with sampled placeholder ids and everything when ``use_tree`` is off go in padded batches of
    ``micro_batch_size`` rows)."""
    if not use_tree:
        live = [s for s in samples if s.num_tokens > 0]
        return [MicroBatch("padded", live[i : i + micro_batch_size]) for i in range(0, len(live), micro_batch_size)]
    groups = group_rows(samples)
    shared = [g for g in groups if tree_ok(g, placeholders)]
    rest = [s for g in groups if not tree_ok(g, placeholders) for s in g]
    out = []
    for i in range(0, len(shared), groups_per_micro_batch):
        chunk = shared[i : i + groups_per_micro_batch]
        out.append(MicroBatch("tree", [s for g in chunk for s in g], chunk))
    out += [MicroBatch("padded", rest[i : i + micro_batch_size]) for i in range(0, len(rest), micro_batch_size)]
    return out


@dataclass
class UpdateResult:
    """What :meth:`Learner.update` did: per-update statistics (token-weighted over this rank's micro-batches;
    ``tokens`` / ``sequences`` are all-rank counts), gradient norms, skipped updates and the learning rate."""

    stats: list[dict[str, float]]
    grad_norms: list[float]
    skipped: int
    lr: float


# ------------------------------------------------------------------------------------ learner
class Learner:
    """Policy (and reference) model, optimizer and LR schedule of an RL run, under one strategy.

    Every method is collective in a distributed run: all ranks call it, in the same order.

    Args:
        model: the ``model`` section (:class:`keye.train.sections.ModelSection`).
        train: the ``train`` section (:class:`keye.rl.config.RLTrainSection`: freezing, optimizer, schedule,
            strategy).
        algorithm: the ``algorithm`` section (reference model, PPO epochs, mini- and micro-batches).
        tree: the ``tree`` section (kernel, groups per micro-batch).
        sampling: the run's :class:`~keye.rl.rollout.settings.SamplingSettings` (log-probs use its temperature).
        info: the process group description from :func:`keye.train.dist.init_distributed`.
        model_path: resolved policy checkpoint directory.
    Raises:
        KeyeConfigError: an unknown strategy or reference placement, or DeepSpeed missing for ``zero3``.
    """

    def __init__(self, *, model: Any, train: Any, algorithm: Any, tree: Any, sampling: SamplingSettings,
                 info: kdist.DistInfo, model_path: str | Path):
        from keye.model.keye_vl import KeyeVL

        self.train_cfg, self.algorithm, self.tree_cfg, self.sampling, self.info = train, algorithm, tree, sampling, info
        strategy = train.strategy if info.distributed else "none"
        if strategy not in STRATEGIES:
            raise KeyeConfigError(f"train.strategy: {strategy!r} is not an RL strategy; use one of {list(STRATEGIES)}")
        self.strategy = strategy
        self.sharded = strategy in SHARDED
        self.dtype = resolve_dtype(model.dtype, info.device)
        policy = KeyeVL.from_pretrained(model_path, torch_dtype=self.dtype, attn_implementation=model.attn_implementation)
        policy.train()
        if model.gradient_checkpointing:
            policy.gradient_checkpointing_enable()
        self.frozen = apply_freezing(policy, train)
        # every rank must run the same modules in the same order when the weights are sharded
        policy.always_run_vision = policy.collective_forward = self.sharded
        self.model = policy
        self.placeholders = placeholder_ids(policy)
        self.vision_params = {id(p) for n, p in policy.named_parameters() if n.startswith(("visual.", "mlp_AR."))}
        self.ref_placement = self._reference_placement(algorithm.reference_placement)
        self.ref_model = None
        if algorithm.reference:
            self.ref_model = load_inference_model(algorithm.reference_path or model.path, dtype=self.dtype,
                                                  attn_implementation=model.attn_implementation, device="cpu")
            self.ref_model.always_run_vision = self.ref_model.collective_forward = self.ref_placement == "sharded"
            if self.ref_placement == "device" or strategy == "fsdp2":
                self.ref_model.to(info.device)
        self.ref_module = self._wrap()
        # what runs the policy's forward: the DeepSpeed engine under ZeRO-3 (its forward sets up the backward)
        self.policy = self.wrapped.module
        self.scheduler = build_scheduler(self.optimizer, train, train.steps)
        self.trainable = [p for p in policy.parameters() if p.requires_grad]
        self._stream_parts: list[dict[str, Any]] = []  # records of the streaming update in progress

    @classmethod
    def from_config(cls, cfg: Any, info: kdist.DistInfo, *, model_path: str | Path) -> Learner:
        """The learner of an :class:`keye.rl.config.RLEPConfig` (its ``model``, ``train``, ``algorithm``, ``tree``
        sections and the sampling settings of ``rollout``)."""
        return cls(model=cfg.model, train=cfg.train, algorithm=cfg.algorithm, tree=cfg.tree,
                   sampling=SamplingSettings.from_config(cfg.rollout), info=info, model_path=model_path)

    # ------------------------------------------------------------------------------ plumbing
    def _reference_placement(self, placement: str) -> str:
        """Where the reference model lives: ``auto`` is sharded like a sharded policy, else on the device."""
        if placement not in ("auto", "sharded", "cpu", "device"):
            raise KeyeConfigError(f"algorithm.reference_placement: {placement!r}; use auto, sharded, cpu or device")
        if placement == "auto":
            placement = "sharded" if self.sharded else "device"
        return "device" if placement == "sharded" and not self.sharded else placement

    def _wrap(self) -> Any:
        """Wrap the policy for the strategy and build its optimizer (after FSDP2, whose parameters are DTensors;
        before DeepSpeed, which takes it); shard a ``sharded`` reference the same way. Returns what runs the
        reference forward (the model, or its ZeRO-3 inference engine)."""
        policy, ref, info = self.model, self.ref_model, self.info
        shard_ref = ref is not None and self.ref_placement == "sharded"
        if self.strategy == "zero3":
            import deepspeed

            self.optimizer = build_optimizer(policy, self.train_cfg)
            self.wrapped = kdist.wrap_model(policy, "zero3", info, optimizer=self.optimizer,
                                            deepspeed_config=self._deepspeed_config(train=True))
            # lm_head is read inside KeyeVL.forward (chunked log-probs), not through its own forward
            deepspeed.zero.register_external_parameter(policy, policy.lm_head.weight)
            if not shard_ref:
                return ref
            engine, *_ = deepspeed.initialize(model=ref, config=self._deepspeed_config(train=False))
            deepspeed.zero.register_external_parameter(ref, ref.lm_head.weight)
            return engine
        self.wrapped = kdist.wrap_model(policy, "fsdp2" if self.strategy == "fsdp2" else "none", info)
        if shard_ref:
            from torch.distributed.fsdp import fully_shard

            for layer in [*ref.model.layers, *ref.visual.vision_model.encoder.layers]:
                fully_shard(layer)
            fully_shard(ref)
        self.optimizer = build_optimizer(policy, self.train_cfg)
        return ref

    def _deepspeed_config(self, *, train: bool) -> dict[str, Any]:
        ds = kdist.deepspeed_settings(self.train_cfg.deepspeed_config or DEFAULT_ZERO3, world_size=self.info.world_size,
                                      accumulation=1, grad_clip=self.train_cfg.grad_clip if train else 0.0,
                                      dtype=self.dtype, device_type=self.info.device.type)
        # the learner owns accumulation: any number of backwards, then one step() (DeepSpeed >= 0.18)
        ds["managed_gradient_accumulation"] = False
        if not train:
            ds.pop("optimizer", None)
            ds.pop("scheduler", None)
        return ds

    @property
    def device(self) -> torch.device:
        """The device the policy computes on."""
        return self.info.device

    @property
    def config(self) -> Any:
        """The policy's :class:`keye.KeyeVLConfig` (token ids, vision settings)."""
        return self.model.config

    def save_checkpoint(self, ckpt_dir: Path, run_state: Any, trainer_state: dict[str, Any], processor: Any) -> None:
        """Write a resumable checkpoint (official model export, optimizer, scheduler, RNG, ``run_state``); the
        layout of :func:`keye.train.checkpoint.save_checkpoint` (collective)."""
        from keye.train.checkpoint import save_checkpoint

        save_checkpoint(Path(ckpt_dir), self.wrapped, self.optimizer, self.scheduler, run_state, trainer_state,
                        processor, self.info, False)

    def load_checkpoint(self, ckpt_dir: Path, run_state: Any) -> dict[str, Any]:
        """Restore :meth:`save_checkpoint`; returns the trainer state (collective)."""
        from keye.train.checkpoint import load_checkpoint

        return load_checkpoint(Path(ckpt_dir), self.wrapped, self.optimizer, self.scheduler, run_state, self.info,
                               False)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.wrapped.is_deepspeed:
            self.wrapped.engine.backward(loss, scale_wrt_gas=False)
        else:
            loss.backward()

    def _dummy(self, module: Any) -> torch.Tensor:
        """A one-token forward (vision tower included via ``always_run_vision``) returning a zero loss: the
        padding that keeps every rank's sequence of sharded collectives equal."""
        dev = torch.device("cpu") if self.ref_placement == "cpu" and module is self.ref_module else self.device
        ids = torch.zeros(1, 2, dtype=torch.long, device=dev)
        req = LogprobRequest(torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                             torch.zeros(1, dtype=torch.long, device=dev))
        return module(input_ids=ids, logprob_request=req).token_logp.sum() * 0.0

    def _forward(self, module: Any, mb: MicroBatch, *, temperature: float, entropy: bool,
                 pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]:
        """(logp [B, T], mask [B, T], entropy or None, padded batch or None) of one micro-batch."""
        kernel = self.tree_cfg.kernel
        core = getattr(module, "module", module)
        if mb.kind == "tree":
            logp, mask, ent = tree_forward(core, mb.groups, temperature=temperature, kernel=kernel, entropy=entropy,
                                           call=module)
            return logp, mask, ent, None
        batch = collate_samples(mb.samples, pad_id, self.placeholders)
        out = token_logprobs(module, batch, batch["responses"], batch["response_attention"], temperature=temperature,
                             chunk_size=DEFAULT_CHUNK_TOKENS, with_entropy=entropy)
        return out.logp, batch["response_mask"].to(out.logp.device), out.entropy, batch

    def _run(self, mbs: list[MicroBatch], fn, *, collective: bool = True) -> None:
        """Call ``fn(mb)`` for each micro-batch; sharded ranks with fewer micro-batches run ``fn(None)``
        (a dummy) until every rank has run the same number."""
        n = kdist.all_max(len(mbs), self.device) if self.sharded and collective else len(mbs)
        for i in range(n):
            fn(mbs[i] if i < len(mbs) else None)

    # ------------------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[RolloutSample], *, target: str = "old_logp", pad_id: int,
                         use_tree: bool) -> None:
        """Fill ``sample.old_logp`` (the current policy) or ``sample.ref_logp`` (the reference model) for
        every live sample, in micro-batches of ``algorithm.micro_batch_size`` rows (or
        ``tree.groups_per_micro_batch`` groups on the shared-prefix path).

        Raises:
            KeyeConfigError: ``target="ref_logp"`` without ``algorithm.reference``.
        """
        if target == "ref_logp" and self.ref_model is None:
            raise KeyeConfigError("reference log-probs need algorithm.reference: true")
        module = self.policy if target == "old_logp" else self.ref_module
        temperature = self.sampling.temperature
        a = self.algorithm
        mbs = plan_micro_batches(samples, use_tree=use_tree, placeholders=self.placeholders,
                                 groups_per_micro_batch=self.tree_cfg.groups_per_micro_batch,
                                 micro_batch_size=a.micro_batch_size)
        was_training = self.model.training
        self.model.eval()

        def one(mb: MicroBatch | None) -> None:
            if mb is None:
                self._dummy(module)
                return
            # (a CPU reference model takes its inputs on the CPU: the log-prob code follows the model's device)
            logp, _, _, _ = self._forward(module, mb, temperature=temperature, entropy=False, pad_id=pad_id)
            for row, s in zip(logp, mb.samples):
                setattr(s, target, row[: s.num_tokens].float().cpu())

        try:
            # an unsharded reference model (device / cpu) runs no collective: no padding needed
            self._run(mbs, one, collective=not (target == "ref_logp" and self.ref_placement != "sharded"))
        finally:
            self.model.train(was_training)

    # ------------------------------------------------------------------------------ update
    def update(self, samples: Sequence[RolloutSample], *, n_groups: int, seed: int, pad_id: int,
               use_tree: bool, loss_kwargs: dict[str, Any]) -> UpdateResult:
        """``algorithm.ppo_epochs`` x ``algorithm.mini_batches`` optimizer updates on ``samples`` (with
        ``advantage`` and ``old_logp`` set; ``ref_logp`` with a KL loss), split into mini-batches of whole
        groups by a generator seeded with ``seed``; then one scheduler step.

        Every micro-batch loss is normalised by the loss-token (and sequence) count of its whole mini-batch
        over all ranks, so the update equals the one-process update on the union of the ranks' samples. A
        mini-batch without a loss token on any rank is skipped on every rank (no AdamW step on zeros).
        """
        a = self.algorithm
        gen = torch.Generator().manual_seed(seed)
        group_ids = torch.tensor([s.group for s in samples], dtype=torch.long)
        per_mb = max(1, -(-n_groups // a.mini_batches))
        stats_list: list[dict[str, float]] = []
        grad_norms: list[float] = []
        skipped = 0
        for _ in range(a.ppo_epochs):
            idxs = group_minibatches(group_ids, per_mb, generator=gen) if samples else []
            # every rank runs exactly mini_batches updates (collectives inside), empty ones included
            idxs = list(idxs) + [torch.zeros(0, dtype=torch.long)] * (a.mini_batches - len(idxs))
            for idx in idxs:
                st = self.accumulate([samples[i] for i in idx.tolist()], pad_id=pad_id, use_tree=use_tree,
                                     loss_kwargs=loss_kwargs)
                if st is None:
                    skipped += 1
                    continue
                grad_norms.append(self._step(no_vision=not st.pop("_vision")))
                stats_list.append(st)
        lr = self.scheduler.get_last_lr()[0]  # before the scheduler moves on to the next step's rate
        with warnings.catch_warnings():
            # An update whose mini-batches were all skipped still advances the schedule (the rate follows
            # updates, not optimizer steps); torch warns about that order, which here is intended.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()
        return UpdateResult(stats_list, grad_norms, skipped, lr)

    def accumulate(self, chosen: Sequence[RolloutSample], *, pad_id: int, use_tree: bool,
                   loss_kwargs: dict[str, Any]) -> dict[str, float] | None:
        """Forward/backward one mini-batch (this rank's share), micro-batch by micro-batch, into the
        gradients (no optimizer step). Returns the statistics, or None when no rank has a loss token (then
        nothing was computed, on any rank).

        Each micro-batch loss is normalised by the loss-token (and sequence) count of the whole mini-batch
        over all ranks and multiplied by the world size (every layout averages gradients over ranks), so
        the accumulated gradient is the one-process gradient of the union of the ranks' samples.
        """
        mbs = self._plan(chosen, use_tree)
        local_tok, local_seq, vision = self._counts(chosen, mbs)
        counts = kdist.reduce_sums({"tok": local_tok, "seq": local_seq, "vision": vision}, self.device)
        n_tok, n_seq = counts["tok"], counts["seq"]
        if not n_tok:
            # no rank has a loss token: an AdamW step on zero gradients would still move the weights
            # (momentum, weight decay) and advance its step count; every rank skips together
            return None
        part = self._accumulate(mbs, pad_id=pad_id, loss_kwargs=loss_kwargs, n_tok=max(n_tok, 1.0),
                                n_seq=max(n_seq, 1.0))
        st = _part_stats(part)
        st.update(loss=part["loss"], tokens=n_tok, sequences=n_seq, local_tokens=local_tok,
                  _vision=bool(counts["vision"]))
        return st

    def _plan(self, chosen: Sequence[RolloutSample], use_tree: bool) -> list[MicroBatch]:
        return plan_micro_batches(chosen, use_tree=use_tree, placeholders=self.placeholders,
                                  groups_per_micro_batch=self.tree_cfg.groups_per_micro_batch,
                                  micro_batch_size=self.algorithm.micro_batch_size)

    def _counts(self, chosen: Sequence[RolloutSample], mbs: list[MicroBatch]) -> tuple[float, float, float]:
        """This rank's loss tokens, sequences with a loss token, and whether any micro-batch has pixels."""
        seqs = sum(1 for mb in mbs for s in mb.samples if loss_token_count([s], self.placeholders) > 0)
        return (float(loss_token_count(chosen, self.placeholders)), float(seqs),
                float(any(mb.has_vision for mb in mbs)))

    def _accumulate(self, mbs: list[MicroBatch], *, pad_id: int, loss_kwargs: dict[str, Any], n_tok: float,
                    n_seq: float) -> dict[str, Any]:
        """Forward/backward ``mbs`` with every micro-batch loss normalised by ``n_tok`` / ``n_seq`` and multiplied
        by the world size; returns the token-weighted statistic sums, their weight and the summed loss."""
        temperature = self.sampling.temperature
        use_ref = bool(loss_kwargs.get("kl_coef", 0.0))
        world = self.info.world_size
        part: dict[str, Any] = {"totals": {}, "w": 0.0, "loss": 0.0}
        totals = part["totals"]

        def one(mb: MicroBatch | None) -> None:
            if mb is None:
                self._backward(self._dummy(self.policy))
                return
            logp, mask, ent, batch = self._forward(self.policy, mb, temperature=temperature, entropy=True,
                                                   pad_id=pad_id)
            old, ref, adv, rollout = _targets(mb, logp.shape[1], use_ref, batch)
            dev = logp.device
            extra = {}
            if rollout is not None and loss_kwargs.get("tis_cap") is not None:
                extra["rollout_logp"] = rollout.to(dev)
            loss, st = policy_loss(logp, old.to(dev), adv.to(dev), mask, ref_logp=ref.to(dev) if use_ref else None,
                                   entropy=ent, global_token_count=n_tok, global_seq_count=n_seq,
                                   **loss_kwargs, **extra)
            # DDP / FSDP / ZeRO average gradients over ranks: multiply back to the global sum
            self._backward(loss * world)
            part["loss"] += float(loss.detach())
            w = st["num_tokens"]
            part["w"] += w
            for k, v in st.items():
                if k not in ("num_tokens", "pg_loss", "ratio_max", "ratio_min"):
                    totals[k] = totals.get(k, 0.0) + v * w
            totals["ratio_max"] = max(totals.get("ratio_max", float("-inf")), st["ratio_max"])
            totals["ratio_min"] = min(totals.get("ratio_min", float("inf")), st["ratio_min"])

        self._run(mbs, one)
        return part

    # ------------------------------------------------------------------------------ streaming update
    def accumulate_part(self, chosen: Sequence[RolloutSample], *, pad_id: int, use_tree: bool,
                        loss_kwargs: dict[str, Any]) -> dict[str, Any]:
        """One part of a streaming update (``rl.update: streaming``): forward/backward this rank's share of the
        groups that have completed (``advantage`` and ``old_logp`` set), each micro-batch loss in sum form
        (token and sequence normaliser 1), while later groups are still being generated. Returns the part's
        record for :meth:`finish_update`. Collective (sharded ranks pad with dummy forwards).

        The normaliser of the whole batch is known only when its last group is in; :meth:`finish_update` then
        divides the accumulated gradient by it. The gradient is linear in that factor, so the update equals
        :meth:`update` with one epoch and one mini-batch over the same samples (up to float rounding)."""
        mbs = self._plan(chosen, use_tree)
        tok, seq, vision = self._counts(chosen, mbs)
        part = self._accumulate(mbs, pad_id=pad_id, loss_kwargs=loss_kwargs, n_tok=1.0, n_seq=1.0)
        part.update(tok=tok, seq=seq, vision=vision)
        return part

    def finish_update(self, parts: Sequence[dict[str, Any]], *, loss_kwargs: dict[str, Any]) -> UpdateResult:
        """Step once for a streaming update whose groups went through :meth:`accumulate_part` (``parts``: this
        rank's records): the gradient is divided by the batch's loss-token count over all ranks
        (``token-mean``; the sequence count for the ``seq-mean-*`` aggregations), then clipped and applied; a
        batch without any loss token on any rank is skipped (no AdamW step), as :meth:`update` skips it; then
        one scheduler step. Collective."""
        local_tok = sum(p["tok"] for p in parts)
        counts = kdist.reduce_sums({"tok": local_tok, "seq": sum(p["seq"] for p in parts),
                                    "vision": float(any(p["vision"] for p in parts))}, self.device)
        n_tok, n_seq = counts["tok"], counts["seq"]
        stats, norms, skipped = [], [], 0
        if n_tok:
            token_mean = loss_kwargs.get("loss_agg", "token-mean") == "token-mean"
            scale = 1.0 / max(n_tok if token_mean else n_seq, 1.0)
            self._scale_gradients(scale)
            norms.append(self._step(no_vision=not counts["vision"]))
            merged: dict[str, Any] = {"totals": {}, "w": 0.0, "loss": 0.0}
            for p in parts:
                merged["w"] += p["w"]
                merged["loss"] += p["loss"] * scale
                for k, v in p["totals"].items():
                    if k == "ratio_max":
                        merged["totals"][k] = max(merged["totals"].get(k, float("-inf")), v)
                    elif k == "ratio_min":
                        merged["totals"][k] = min(merged["totals"].get(k, float("inf")), v)
                    else:
                        merged["totals"][k] = merged["totals"].get(k, 0.0) + v
            st = _part_stats(merged)
            st.update(loss=merged["loss"], tokens=n_tok, sequences=n_seq, local_tokens=local_tok)
            stats.append(st)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            if self.wrapped.is_deepspeed:
                self.wrapped.engine.zero_grad()
            skipped = 1
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.scheduler.step()
        return UpdateResult(stats, norms, skipped, lr)

    def stream_part(self, samples: Sequence[RolloutSample], *, pad_id: int, use_tree: bool,
                    loss_kwargs: dict[str, Any]) -> None:
        """One part of a streaming update from start to gradient: the groups' old log-probs (the proximal policy:
        these weights, unchanged until :meth:`finish_stream`), reference log-probs with a reference model, their
        group advantages (``algorithm``'s settings) and :meth:`accumulate_part`; the record is kept for
        :meth:`finish_stream`. Collective."""
        self.compute_logprobs(samples, pad_id=pad_id, use_tree=use_tree)
        if self.ref_model is not None:
            self.compute_logprobs(samples, target="ref_logp", pad_id=pad_id, use_tree=use_tree)
        if samples:
            a = self.algorithm
            assign_advantages(samples, std=a.std, eps=a.eps, difficulty=a.difficulty, kl_reward_coef=a.kl_reward_coef)
        self._stream_parts.append(self.accumulate_part(samples, pad_id=pad_id, use_tree=use_tree,
                                                       loss_kwargs=loss_kwargs))

    def finish_stream(self, *, loss_kwargs: dict[str, Any]) -> UpdateResult:
        """:meth:`finish_update` over the parts :meth:`stream_part` kept since the last one. Collective."""
        parts, self._stream_parts = self._stream_parts, []
        return self.finish_update(parts, loss_kwargs=loss_kwargs)

    def _scale_gradients(self, scale: float) -> None:
        """Multiply every accumulated trainable gradient by ``scale`` (ZeRO-3: this rank's partitions)."""
        if self.wrapped.is_deepspeed:
            from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

            for p in self.trainable:
                g = safe_get_local_grad(p)
                if g is not None:
                    safe_set_local_grad(p, g * scale)
            return
        for p in self.trainable:
            if p.grad is not None:
                p.grad.mul_(scale)

    def _step(self, *, no_vision: bool) -> float:
        """Reduce (replicated), clip and apply the accumulated gradients; returns the gradient norm."""
        clip = self.train_cfg.grad_clip
        if self.wrapped.is_deepspeed:
            if no_vision:
                # the dummy vision pass gave the tower exact zeros; one process would have no gradient there
                for p in self.trainable:
                    if id(p) in self.vision_params:
                        p.grad = None
            self.wrapped.engine.step()
            return float(self.wrapped.engine.get_global_grad_norm() or 0.0)
        if self.strategy == "fsdp2" and no_vision:
            for p in self.trainable:
                if id(p) in self.vision_params:
                    p.grad = None
        if not self.sharded:
            average_gradients(self.trainable, self.info.world_size)
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.trainable if p.grad is not None], clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------------------ weights
    def export_weights(self, max_bytes: int = DEFAULT_EXPORT_BYTES) -> Iterator[dict[str, torch.Tensor]]:
        """The current policy weights as consecutive shards ``{name: full tensor}`` of at most ``max_bytes``
        (a larger tensor is a shard of its own), names as in the official checkpoints.

        Collective: every rank iterates to the end; every rank receives every shard (each rank's colocated
        rollout engine needs the whole model). Sharded layouts gather one tensor at a time, so no rank ever
        holds more than one shard of full tensors beyond its own partition.
        """
        bucket: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in self._full_tensors():
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > max_bytes:
                yield bucket
                bucket, size = {}, 0
            bucket[name] = tensor
            size += nbytes
        if bucket:
            yield bucket

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        model = self.model
        if self.strategy == "zero3":
            import deepspeed

            for name, p in model.named_parameters():
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    yield name, p.detach().clone()
            for name, b in model.named_buffers():
                if name in model.state_dict():
                    yield name, b.detach().clone()
            return
        for name, t in model.state_dict().items():
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield name, t.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model state on CPU (complete on rank 0; for checkpoints and checksums)."""
        return kdist.full_state_dict(self.wrapped)

    def checksum(self) -> float:
        """Sum of every weight in float64, identical on every rank (collective; a data-parallel sanity check)."""
        total = 0.0
        for shard in self.export_weights():
            total += float(sum(t.double().sum() for t in shard.values()))
        return total


def _part_stats(part: dict[str, Any]) -> dict[str, float]:
    """Token-weighted means of a part's statistic sums (the ratio extremes as they are)."""
    w = part["w"]
    return {k: (v / w if w and k not in ("ratio_max", "ratio_min") else v) for k, v in part["totals"].items()}


def _targets(mb: MicroBatch, width: int, use_ref: bool, batch: dict[str, torch.Tensor] | None):
    """old / ref / rollout log-probs [B, width] and advantages [B] of a micro-batch's rows."""
    if batch is not None:
        rollout = batch.get("rollout_logp")
        if rollout is not None:
            has = batch.get("has_rollout_logp")
            if has is None or not bool(has.any()):
                rollout = None
            else:  # rows without engine log-probs (replay) get importance weight 1
                rollout = torch.where(has.bool()[:, None], rollout, batch["old_logp"])
        return batch["old_logp"], batch.get("ref_logp"), batch["advantages"], rollout
    rows = mb.samples
    old = torch.zeros(len(rows), width)
    ref = torch.zeros(len(rows), width)
    roll = torch.zeros(len(rows), width)
    have_roll = False
    for j, s in enumerate(rows):
        n = s.num_tokens
        old[j, :n] = s.old_logp[:n]
        if use_ref:
            ref[j, :n] = s.ref_logp[:n]
        r = getattr(s, "rollout_logp", None)
        if r is not None:
            roll[j, :n] = r[:n]
            have_roll = True
        else:
            roll[j, :n] = s.old_logp[:n]  # no engine log-probs (replay): importance weight 1
    adv = torch.tensor([float(s.advantage) for s in rows], dtype=torch.float32)
    return old, ref, adv, (roll if have_roll else None)
