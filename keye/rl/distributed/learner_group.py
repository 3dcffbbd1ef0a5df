"""The learner group on Ray: ``rl.ray.learners`` :class:`LearnerActor` s, the ranks of one torch process group
(``train.strategy`` none / ddp / fsdp2 / zero3 across them), behind :class:`RemoteLearner`, the driver's proxy with
the :class:`keye.rl.learner.learner.Learner` interface the RL loop uses.

The driver splits each step's groups over the ranks (whole groups, :func:`assign_groups`) and plans the
mini-batches itself exactly as one process would (:func:`plan_updates`), so N ranks compute the one-process update
on the same samples (the learner is world-invariant); per-rank statistics are merged token-weighted
(:func:`merge_updates`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keye.errors import KeyeConfigError, KeyeError
from keye.rl.algorithms.sampling import group_minibatches
from keye.rl.distributed.ray_session import RaySession, free_port, torch_threads
from keye.rl.distributed.weight_sync import broadcast_shards, open_sync_group
from keye.rl.learner.learner import UpdateResult
from keye.rl.rollout.rollout_manager import WorkerProtocolError
from keye.rl.rollout.samples import RolloutSample

try:
    import ray
except ImportError as _err:  # pragma: no cover - depends on the installation
    raise KeyeConfigError(f"rl.engine=ray needs the 'ray' package (pip install 'keye[ray]'): {_err}") from None

log = logging.getLogger("keye.rl.distributed.learner_group")


class LearnerFailed(KeyeError, RuntimeError):
    """A learner rank's process died: the group cannot go on (its peers wait in collectives for the dead rank)
    and must be rebuilt from the last checkpoint (:func:`keye.recipes.rlep.train` does that)."""


def plan_updates(samples: Sequence[RolloutSample], *, n_groups: int, seed: int, ppo_epochs: int,
                 mini_batches: int) -> list[list[int]]:
    """The optimizer updates of one step as lists of sample indices: ``ppo_epochs`` x ``mini_batches``
    mini-batches of whole groups, drawn exactly as :meth:`keye.rl.learner.learner.Learner.update` draws them in one
    process (a generator seeded with ``seed``, ``ceil(n_groups / mini_batches)`` groups each, empty
    mini-batches appended so every epoch has ``mini_batches`` entries)."""
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.tensor([s.group for s in samples], dtype=torch.long)
    per_mb = max(1, -(-n_groups // mini_batches))
    plan: list[list[int]] = []
    for _ in range(ppo_epochs):
        idxs = [i.tolist() for i in group_minibatches(group_ids, per_mb, generator=gen)] if samples else []
        plan += idxs + [[] for _ in range(mini_batches - len(idxs))]
    return plan


def assign_groups(samples: Sequence[RolloutSample], ranks: int) -> list[list[int]]:
    """Split sample indices over ``ranks`` by whole groups: groups (largest token count first, ties by first
    appearance) go to the rank with the fewest tokens so far (ties: lowest rank); each rank's indices keep
    the batch order. Deterministic, and with one rank simply ``[0, 1, ..., len(samples) - 1]``."""
    if ranks == 1:
        return [list(range(len(samples)))]
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    order = list(groups.values())
    cost = [sum(samples[i].num_tokens + samples[i].inputs.length for i in g) for g in order]
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for j in sorted(range(len(order)), key=lambda j: (-cost[j], j)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r] += order[j]
        load[r] += cost[j]
    return [sorted(x) for x in out]


_MERGE_SKIP = ("loss", "tokens", "sequences", "local_tokens", "ratio_max", "ratio_min")


def merge_updates(results: Sequence[UpdateResult]) -> UpdateResult:
    """One :class:`UpdateResult` from the learner ranks' results of the same updates, shaped as one process
    would report it on the union of their samples: per update, statistics weighted by each rank's
    ``local_tokens`` (ranks without loss tokens add nothing), ``loss`` summed (each rank's share is already
    normalised by the global token count), ``local_tokens`` summed, ``ratio_max`` / ``ratio_min`` over
    ranks; gradient norms, skipped count and learning rate are the same on every rank (rank 0's).

    Raises:
        WorkerProtocolError: the ranks ran different numbers of updates (they must step together).
    """
    first = results[0]
    if len(results) == 1:
        return first
    for k, r in enumerate(results[1:], 1):
        if len(r.stats) != len(first.stats) or r.skipped != first.skipped:
            raise WorkerProtocolError(f"learner rank {k} ran {len(r.stats)} updates ({r.skipped} skipped), rank 0 "
                                      f"{len(first.stats)} ({first.skipped} skipped): the ranks left lockstep")
    merged = []
    for i in range(len(first.stats)):
        per = [r.stats[i] for r in results]
        live = [(st, float(st["local_tokens"])) for st in per if st["local_tokens"] > 0]
        total = sum(w for _, w in live)
        st: dict[str, float] = {"loss": sum(float(x["loss"]) for x in per), "tokens": per[0]["tokens"],
                                "sequences": per[0]["sequences"], "local_tokens": total}
        keys = sorted({k for x, _ in live for k in x} - set(_MERGE_SKIP))
        for k in keys:
            st[k] = sum(float(x.get(k, 0.0)) * w for x, w in live) / total
        if any("ratio_max" in x for x, _ in live):
            st["ratio_max"] = max(x["ratio_max"] for x, _ in live if "ratio_max" in x)
            st["ratio_min"] = min(x["ratio_min"] for x, _ in live if "ratio_min" in x)
        merged.append(st)
    return UpdateResult(merged, list(first.grad_norms), first.skipped, first.lr)


# --------------------------------------------------------------------------------------------- actors
class _HeldState:
    """The driver's run state as the checkpoint code sees it (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, state: Any = None):
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state



class LearnerActor:
    """One learner rank: a :class:`keye.rl.learner.learner.Learner` in its own process, joined with the other ranks
    in one torch process group. Built empty; :meth:`setup` (called on every rank at once) joins the group
    and builds the learner."""

    def __init__(self, cfg: Any, model_path: str, rank: int, world: int, threads: int):
        torch.set_num_threads(threads)
        self.cfg, self.model_path, self.rank, self.world = cfg, model_path, rank, world
        self.learner: Any = None
        self.processor: Any = None
        self.sync: tuple[Any, Any] | None = None  # (store, group) of the weight broadcast

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def endpoint(self) -> tuple[str, int]:
        """(node IP, a free port): rank 0's is the process group's rendezvous."""
        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group (``WORLD_SIZE > 1``) and build the learner; returns what the driver's proxy
        exposes (model config, frozen towers, strategy, dtype, reference model presence)."""
        from keye.processing.processor import KeyeProcessor
        from keye.rl.learner.learner import Learner
        from keye.tiny import resolve_model_path
        from keye.train import dist as kdist

        if self.world > 1:
            # one GPU per actor at most (Ray sets CUDA_VISIBLE_DEVICES), so the local device is always 0
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        info = kdist.init_distributed(self.cfg.train.device)
        kdist.seed_everything(self.cfg.train.seed)
        self.learner = Learner.from_config(self.cfg, info, model_path=Path(self.model_path))
        cm = self.cfg.model
        self.processor = KeyeProcessor.from_pretrained(resolve_model_path(cm.processor or cm.path))
        lr = self.learner
        return {"config": lr.config, "frozen": lr.frozen, "strategy": lr.strategy, "sharded": lr.sharded,
                "dtype": lr.dtype, "has_ref": lr.ref_model is not None, "ref_placement": lr.ref_placement,
                "device": str(info.device), "node": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def compute_logprobs(self, samples: list[RolloutSample], target: str, pad_id: int,
                         use_tree: bool) -> list[torch.Tensor | None]:
        """:meth:`Learner.compute_logprobs` on this rank's share; returns ``target`` of every sample."""
        self.learner.compute_logprobs(samples, target=target, pad_id=pad_id, use_tree=use_tree)
        return [getattr(s, target) for s in samples]

    def stream_part(self, samples: list[RolloutSample], pad_id: int, use_tree: bool,
                    loss_kwargs: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
        """:meth:`Learner.stream_part` on this rank's share of a part; returns each sample's (old_logp, ref_logp,
        advantage) for the driver's metrics."""
        self.learner.stream_part(samples, pad_id=pad_id, use_tree=use_tree, loss_kwargs=loss_kwargs)
        return [(s.old_logp, s.ref_logp, s.advantage) for s in samples]

    def finish_stream(self, loss_kwargs: dict[str, Any]) -> UpdateResult:
        """:meth:`Learner.finish_stream` (collective)."""
        return self.learner.finish_stream(loss_kwargs=loss_kwargs)

    def update(self, samples: list[RolloutSample], plan: list[list[int]], pad_id: int, use_tree: bool,
               loss_kwargs: dict[str, Any]) -> UpdateResult:
        """The step's optimizer updates on this rank's share: for each planned mini-batch (indices into
        ``samples``; empty ones included, every rank runs every update) accumulate and step, as
        :meth:`Learner.update` does with its own plan; then one scheduler step."""
        lr = self.learner
        stats: list[dict[str, float]] = []
        norms: list[float] = []
        skipped = 0
        for idx in plan:
            st = lr.accumulate([samples[i] for i in idx], pad_id=pad_id, use_tree=use_tree, loss_kwargs=loss_kwargs)
            if st is None:
                skipped += 1
                continue
            norms.append(lr._step(no_vision=not st.pop("_vision")))
            stats.append(st)
        rate = lr.scheduler.get_last_lr()[0]
        lr.scheduler.step()
        return UpdateResult(stats, norms, skipped, rate)

    def export_shards(self, max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The policy weights as CPU shards of at most ``max_bytes`` (a streaming generator: each shard
        becomes one object-store object owned by the caller)."""
        for shard in self.learner.export_weights(max_bytes):
            yield {k: v.detach().cpu() for k, v in shard.items()}

    def drain_export(self, max_bytes: int) -> int:
        """Walk the collective export without keeping anything (ranks > 0 while rank 0 streams)."""
        return sum(len(shard) for shard in self.learner.export_weights(max_bytes))

    def open_sync_group(self, addr: str, port: int, world: int, backend: str, timeout_s: float) -> None:
        """Join (as rank 0, hosting the store) a new weight-broadcast group with the rollout workers."""
        self.sync = None  # a previous group (with a dead member) is dropped first
        self.sync = open_sync_group(addr, port, 0, world, backend, timeout_s)
        self.sync_device = self.learner.device if backend == "nccl" else torch.device("cpu")

    def broadcast_weights(self, max_bytes: int) -> int:
        """Broadcast the exported weights to the rollout workers (:func:`broadcast_shards`); returns the
        number of tensors. If the broadcast fails (a worker died) the export is still walked to its end, so
        the other learner ranks are not left waiting in its collectives."""
        shards = self.learner.export_weights(max_bytes)
        try:
            return broadcast_shards(self.sync[1], shards, self.sync_device)
        except Exception:
            for _ in shards:
                pass
            raise

    def save(self, ckpt_dir: str, run_state: Any, trainer_state: dict[str, Any]) -> None:
        """:meth:`Learner.save_checkpoint` with the driver's run state (collective)."""
        self.learner.save_checkpoint(Path(ckpt_dir), _HeldState(run_state), trainer_state, self.processor)

    def load(self, ckpt_dir: str) -> tuple[dict[str, Any], Any]:
        """:meth:`Learner.load_checkpoint` (collective); returns (trainer state, the saved driver run state)."""
        held = _HeldState()
        trainer = self.learner.load_checkpoint(Path(ckpt_dir), held)
        return trainer, held.state

    def checksum(self) -> float:
        """:meth:`Learner.checksum` (collective)."""
        return self.learner.checksum()


# --------------------------------------------------------------------------------------------- learner
@dataclass(frozen=True)
class RemoteModel:
    """Where a model of the learner group lives (the driver holds no weights): ``role`` policy or reference,
    the learner ``strategy`` and the number of ranks."""

    role: str
    strategy: str
    ranks: int


class RemoteLearner:
    """The driver's view of the learner group: the :class:`keye.rl.learner.learner.Learner` interface the recipe's
    loop uses, each call fanned out to every rank (all calls are collective on the actors).

    ``model`` / ``ref_model`` are :class:`RemoteModel` descriptions (``ref_model`` None without a reference
    model); ``config``, ``frozen``, ``strategy``, ``sharded``, ``dtype`` are the ranks' values. Both
    ``rl.mode`` s train with it: the synchronous loop through :func:`build_ray_components`, the asynchronous
    one in a :class:`RaySession` of learner bundles only (:func:`keye.rl.distributed.build.build_ray_components`).
    """

    def __init__(self, session: RaySession, cfg: Any, model_path: Path):
        self.session, self.cfg = session, cfg
        rs = cfg.rl.ray
        threads = torch_threads(rs.learner_cpus, rs.torch_threads)
        self.actors = [session.start(LearnerActor, "learner", r, f"keye-learner-{r}", cfg, str(model_path), r,
                                     rs.learners, threads) for r in range(rs.learners)]
        addr, port = ray.get(self.actors[0].endpoint.remote())
        infos = ray.get([a.setup.remote(addr, port) for a in self.actors])
        info = infos[0]
        self.config, self.frozen, self.strategy = info["config"], info["frozen"], info["strategy"]
        self.sharded, self.dtype, self.ref_placement = info["sharded"], info["dtype"], info["ref_placement"]
        self.devices = [x["device"] for x in infos]
        self.model = RemoteModel("policy", self.strategy, len(self.actors))
        self.ref_model = RemoteModel("reference", self.strategy, len(self.actors)) if info["has_ref"] else None
        self._stream: list[tuple[list[RolloutSample], list[list[int]], list[Any]]] = []  # parts sent, not collected
        log.info("learner group: %d rank(s), strategy %s, devices %s", len(self.actors), self.strategy, self.devices)

    def compute_logprobs(self, samples: Sequence[RolloutSample], *, target: str = "old_logp", pad_id: int,
                         use_tree: bool) -> None:
        """Fill ``target`` (``old_logp`` / ``ref_logp``) of every live sample, the groups split over the ranks.

        Raises:
            KeyeConfigError: ``ref_logp`` without ``algorithm.reference``.
        """
        if target == "ref_logp" and self.ref_model is None:
            raise KeyeConfigError("reference log-probs need algorithm.reference: true")
        shares = assign_groups(samples, len(self.actors))
        refs = [a.compute_logprobs.remote([samples[i] for i in idx], target, pad_id, use_tree)
                for a, idx in zip(self.actors, shares)]
        for idx, values in zip(shares, self._get(refs)):
            for i, v in zip(idx, values):
                if samples[i].num_tokens > 0:
                    setattr(samples[i], target, v)

    def update(self, samples: Sequence[RolloutSample], *, n_groups: int, seed: int, pad_id: int, use_tree: bool,
               loss_kwargs: dict[str, Any]) -> UpdateResult:
        """The step's ``ppo_epochs`` x ``mini_batches`` updates (:func:`plan_updates`, as one process plans
        them), each rank accumulating its groups' share of every mini-batch; the merged result
        (:func:`merge_updates`)."""
        a = self.cfg.algorithm
        plan = plan_updates(samples, n_groups=n_groups, seed=seed, ppo_epochs=a.ppo_epochs, mini_batches=a.mini_batches)
        jobs = []
        for actor, idx in zip(self.actors, assign_groups(samples, len(self.actors))):
            pos = {g: j for j, g in enumerate(idx)}
            local = [[pos[i] for i in mb if i in pos] for mb in plan]
            jobs.append(actor.update.remote([samples[i] for i in idx], local, pad_id, use_tree, loss_kwargs))
        return merge_updates(self._get(jobs))

    @property
    def ranks(self) -> int:
        """How many learner ranks (a streaming part holds up to this many groups, one per rank)."""
        return len(self.actors)

    def stream_part(self, samples: Sequence[RolloutSample], *, pad_id: int, use_tree: bool,
                    loss_kwargs: dict[str, Any]) -> None:
        """Send one part of a streaming update to the ranks (whole groups split over them, :func:`assign_groups`)
        without waiting: each rank computes its share's log-probs, advantages and gradient while the driver goes
        on streaming; :meth:`finish_stream` collects them. Calls reach each actor in order, so every rank runs
        the same sequence of collectives."""
        shares = assign_groups(samples, len(self.actors))
        refs = [a.stream_part.remote([samples[i] for i in idx], pad_id, use_tree, loss_kwargs)
                for a, idx in zip(self.actors, shares)]
        self._stream.append((list(samples), shares, refs))

    def busy(self) -> bool:
        """Whether a part sent by :meth:`stream_part` is still being computed (the actors run calls in order, so
        the last part's calls decide); a rank that died reads as not busy, and :meth:`finish_stream` reports it."""
        if not self._stream:
            return False
        refs = self._stream[-1][2]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) < len(refs)

    def finish_stream(self, *, loss_kwargs: dict[str, Any]) -> UpdateResult:
        """Wait for every part sent since the last call, write the ranks' old / reference log-probs and advantages
        into the driver's samples, and step every rank once; returns the merged result (:func:`merge_updates`)."""
        pending, self._stream = self._stream, []
        for samples, shares, refs in pending:
            for idx, values in zip(shares, self._get(refs)):
                for i, (old, ref, adv) in zip(idx, values):
                    samples[i].old_logp, samples[i].ref_logp, samples[i].advantage = old, ref, adv
        return merge_updates(self._get([a.finish_stream.remote(loss_kwargs) for a in self.actors]))

    def export_refs(self, max_bytes: int) -> list[Any]:
        """The current weights as object refs of shards ``{name: tensor}`` (each ``ray.put`` once by rank 0,
        owned by the driver; the other ranks walk the collective export alongside)."""
        stream = self.actors[0].export_shards.options(num_returns="streaming").remote(max_bytes)
        drains = [a.drain_export.remote(max_bytes) for a in self.actors[1:]]
        try:
            refs = list(stream)
        except ray.exceptions.RayActorError as err:
            raise LearnerFailed(f"learner rank 0 died while exporting the weights ({type(err).__name__})") from None
        self._get(drains)
        return refs

    def broadcast_refs(self, max_bytes: int) -> list[Any]:
        """Start the weight broadcast of rank 0 (:meth:`LearnerActor.broadcast_weights`) with the other ranks
        walking the collective export alongside; returns the calls' refs."""
        return ([self.actors[0].broadcast_weights.remote(max_bytes)]
                + [a.drain_export.remote(max_bytes) for a in self.actors[1:]])

    def export_weights(self, max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The current weights as shards in this process (held one at a time), like
        :meth:`Learner.export_weights`."""
        for ref in self.export_refs(max_bytes):
            yield self._get(ref)

    def save_checkpoint(self, ckpt_dir: Path, run_state: Any, trainer_state: dict[str, Any], processor: Any) -> None:
        """Every rank writes its part of the checkpoint layout of :func:`keye.train.checkpoint.save_checkpoint` (rank 0
        the model export, processor and ``trainer_state.pt``) with the driver's ``run_state`` as the loader
        state (``processor`` is the ranks' own copy of the same files). ``ckpt_dir`` must be reachable from
        learner rank 0 and the driver (same machine or shared storage)."""
        state = run_state.state_dict()
        self._get([a.save.remote(str(ckpt_dir), state, trainer_state) for a in self.actors])

    def load_checkpoint(self, ckpt_dir: Path, run_state: Any) -> dict[str, Any]:
        """Every rank restores its part; the driver's ``run_state`` gets the saved one. Returns the trainer
        state."""
        out = self._get([a.load.remote(str(ckpt_dir)) for a in self.actors])
        trainer, held = out[0]
        run_state.load_state_dict(held)
        return trainer

    def checksum(self) -> float:
        """Sum of every weight in float64 (collective over the ranks)."""
        return self._get([a.checksum.remote() for a in self.actors])[0]

    def _get(self, refs: Any) -> Any:
        """``ray.get`` that fails fast when a rank dies: the ranks still alive may be waiting in a collective for
        the dead one (until the process group's timeout), so every call is polled and the first rank found dead
        raises :class:`LearnerFailed` naming it."""
        many = isinstance(refs, list)
        pending = list(refs) if many else [refs]
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    raise LearnerFailed(f"a learner rank died ({type(err).__name__}: {str(err).splitlines()[0]})") from None
        return ray.get(refs)

    def pids(self) -> list[int]:
        """The ranks' process ids."""
        return self._get([a.pid.remote() for a in self.actors])
