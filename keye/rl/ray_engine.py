"""RL on Ray: the learner group, rollout workers and reward workers as Ray actors behind keye's interfaces.

``keye train rlep --config CFG rl.engine=ray`` runs the same loop as the in-process recipe
(:func:`keye.train.rlep.train`); only :func:`keye.train.rlep.build_components` changes, returning driver-side
proxies of actors that live anywhere on a Ray cluster:

* :class:`RemoteLearner` - ``rl.ray.learners`` :class:`LearnerActor` s, the ranks of one torch process group
  (gloo on CPU, NCCL on GPU; ``train.strategy`` fsdp2 / zero3 / ddp across them). The driver splits each
  step's groups over the ranks (whole groups) and plans the mini-batches itself, exactly as one process
  would (:func:`plan_updates`), so N ranks compute the one-process update on the same samples (the learner
  is world-invariant: keye/rl/learner.py). Per-rank update statistics are merged token-weighted
  (:func:`merge_updates`).
* :class:`RemoteEngine` - ``rl.ray.rollout_workers`` :class:`RolloutActor` s, each holding a whole-weight
  :class:`~keye.rl.rollout.LocalRollout` (or :class:`~keye.rl.rollout.VLLMRollout` with
  ``rollout.engine: vllm``). Prompts are split by index; worker ``k`` samples from
  :func:`worker_seed` ``(step seed, k)`` (worker 0 from the step seed itself, so one worker samples exactly
  what the in-process engine samples). Every call carries the random state it starts from and the weight
  version it must serve, so a call is a pure function of (weights, state, prompts) and can be re-sent.
* :class:`RemoteScorer` - ``rl.ray.reward_workers`` :class:`RewardActor` s, each holding a
  :class:`~keye.rl.scoring.RewardScorer`; a share slower than ``rl.ray.reward_timeout_s`` is killed and re-run.

Weight sync (:meth:`RemoteEngine.sync_from`, ``rl.ray.weight_sync``): after each update learner rank 0 either
streams its exported shards into the Ray object store (each shard ``ray.put`` once, by a streaming generator)
and every rollout worker loads them one by one, or broadcasts them to the workers in a process group of their
own (NCCL on GPUs, gloo on CPUs; :func:`broadcast_shards`); the other learner ranks walk the same collective
export alongside. Versions: a worker records the
version it serves, ``generate`` names the version it expects (a mismatch is a protocol error) and each
sample's ``metadata["weight_version"]`` records it; an actor runs one call at a time, so a load never lands
inside a generation and no token mixes versions.

Faults: a rollout or reward worker whose process dies (``RayActorError``) - or a reward share that times
out - is replaced by a new actor from the same factory (same placement bundle); a rollout worker first loads
the current version (the shards kept in the object store, or a new broadcast) and the request is re-sent with
the same start state, so the results equal an uninterrupted run and nothing is counted twice. Every event is logged with
running counts and appended to ``<checkpoint.out_dir>/ray_events.jsonl``. The learner group is not
restarted: a learner failure ends the run, which resumes from its last checkpoint.

Starting: ``rl.ray.address`` None starts a local cluster (``ray.init`` with this machine's CPUs and GPUs);
``auto`` (or ``host:port``) joins one started with ``ray start --head`` / ``ray start --address ...``. An
already initialised Ray (a test, a notebook) is used as it is. All actors share one placement group
(``rl.ray.placement``: PACK by default); see docs/rl_ray.md.

This module is imported only with ``rl.engine: ray``: the in-process recipe never imports Ray.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keye.errors import KeyeConfigError, KeyeError
from keye.rl.learner import UpdateResult
from keye.rl.rollout import PromptInputs, RolloutSample
from keye.rl.rollout_manager import WorkerProtocolError
from keye.rl.sampling import group_minibatches
from keye.rl.scoring import Scores

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as _err:  # pragma: no cover - depends on the installation
    raise KeyeConfigError(f"rl.engine=ray needs the 'ray' package (pip install 'keye[ray]'): {_err}") from None

log = logging.getLogger("keye.rl.ray_engine")


class RayWorkerError(KeyeError, RuntimeError):
    """A Ray worker kept failing on the same request (more than ``rl.ray.max_restarts`` restarts)."""


# --------------------------------------------------------------------------------------------- config
def check_ray_config(cfg: Any, world_size: int = 1) -> None:
    """Validate ``cfg.rl`` for the Ray engine; raises :class:`KeyeConfigError` naming the key.

    ``world_size`` is the driver's: the Ray driver is one process (the learner ranks are actors), so it must
    not be launched under torchrun.
    """
    rl, rs = cfg.rl, cfg.rl.ray
    if world_size != 1:
        raise KeyeConfigError(f"rl.engine=ray runs from one driver process (got a world of {world_size}): start it "
                              "with plain `keye train rlep`, not torchrun; rl.ray.learners sets the learner ranks")
    if rl.max_staleness < 0:
        raise KeyeConfigError(f"rl.max_staleness must be >= 0, got {rl.max_staleness}")
    for key in ("learners", "rollout_workers"):
        if getattr(rs, key) < 1:
            raise KeyeConfigError(f"rl.ray.{key} must be >= 1, got {getattr(rs, key)}")
    if rs.reward_workers < 0:
        raise KeyeConfigError(f"rl.ray.reward_workers must be >= 0 (0: score in the driver), got {rs.reward_workers}")
    if rs.max_restarts < 0:
        raise KeyeConfigError(f"rl.ray.max_restarts must be >= 0, got {rs.max_restarts}")
    for key in ("reward_timeout_s", "placement_timeout_s", "sync_timeout_s", "learner_cpus", "rollout_cpus",
                "reward_cpus"):
        if not getattr(rs, key) > 0:
            raise KeyeConfigError(f"rl.ray.{key} must be > 0, got {getattr(rs, key)}")
    for key in ("learner_gpus", "rollout_gpus"):
        v = getattr(rs, key)
        if v is not None and v < 0:
            raise KeyeConfigError(f"rl.ray.{key} must be >= 0 (or null: 1 when the cluster has GPUs), got {v}")
    if rs.torch_threads is not None and rs.torch_threads < 1:
        raise KeyeConfigError(f"rl.ray.torch_threads must be >= 1 (or null), got {rs.torch_threads}")
    if rs.num_cpus is not None and (rs.num_cpus < 1 or rs.address is not None):
        raise KeyeConfigError(f"rl.ray.num_cpus ({rs.num_cpus}) sizes a local cluster: it must be >= 1 and needs "
                              f"rl.ray.address: null (got {rs.address!r})")
    if cfg.rollout.engine == "vllm" and rs.rollout_gpus is not None and rs.rollout_gpus <= 0:
        raise KeyeConfigError("rollout.engine=vllm needs a GPU per rollout worker: set rl.ray.rollout_gpus > 0 "
                              "(or null)")


# --------------------------------------------------------------------------------------------- helpers
def worker_seed(seed: int, index: int) -> int:
    """The sampling seed of rollout worker ``index`` for a step seeded ``seed``: ``seed`` itself for worker 0
    (so one worker reproduces the in-process engine), a distinct deterministic value for the others."""
    if index == 0:
        return seed
    return (seed * 6_364_136_223_846_793_005 + index * 1_442_695_040_888_963_407) % (2**62)


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[lo, hi)`` ranges covering ``range(n)``, sizes differing by at most one (the
    first ``n % parts`` ranges one longer); empty ranges when ``n < parts``."""
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for k in range(parts):
        hi = lo + base + (k < extra)
        out.append((lo, hi))
        lo = hi
    return out


def plan_updates(samples: Sequence[RolloutSample], *, n_groups: int, seed: int, ppo_epochs: int,
                 mini_batches: int) -> list[list[int]]:
    """The optimizer updates of one step as lists of sample indices: ``ppo_epochs`` x ``mini_batches``
    mini-batches of whole groups, drawn exactly as :meth:`keye.rl.learner.Learner.update` draws them in one
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _threads(num_cpus: float, override: int | None) -> int:
    return override if override is not None else max(1, int(num_cpus))


# ---------------------------------------------------------------------------------- broadcast weight sync
def open_sync_group(addr: str, port: int, rank: int, world: int, backend: str, timeout_s: float) -> tuple[Any, Any]:
    """A process group of its own (not the default one: learner ranks already have theirs) for the weight
    broadcast: learner rank 0 is rank 0 and hosts the rendezvous store at ``addr:port``, rollout worker ``k`` is
    rank ``k + 1``. ``backend`` ``nccl`` (GPU tensors) or ``gloo`` (CPU tensors). Returns (store, group); keep
    both alive while the group is used. Every member must call it at the same time."""
    import datetime

    from torch import distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout)
    cls = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    return store, cls(store, rank, world, timeout)


def _bcast(group: Any, t: torch.Tensor) -> None:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([t], opts).wait()


def broadcast_shards(group: Any, shards: Iterator[dict[str, torch.Tensor]], device: torch.device) -> int:
    """Send weight shards from rank 0 of ``group``: per shard a JSON header (names, dtypes, shapes) and one
    byte buffer per dtype (every tensor of that dtype, flattened and concatenated), then an empty header.
    Returns the number of tensors sent. The receivers run :func:`receive_shards`."""
    sent = 0
    for shard in shards:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, t in shard.items():
            by_dtype.setdefault(t.dtype, []).append(name)
        header = [[str(dt).removeprefix("torch."), [[n, list(shard[n].shape)] for n in names]]
                  for dt, names in by_dtype.items()]
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
        _bcast(group, torch.tensor([raw.numel()], dtype=torch.long, device=device))
        _bcast(group, raw)
        for names in by_dtype.values():
            flat = torch.cat([shard[n].detach().to(device).reshape(-1) for n in names])
            _bcast(group, flat.view(torch.uint8))
            sent += len(names)
    _bcast(group, torch.zeros(1, dtype=torch.long, device=device))
    return sent


def receive_shards(group: Any, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The shards :func:`broadcast_shards` sends, one at a time (consume to the end: the sender waits for
    every receiver in each collective)."""
    while True:
        size = torch.zeros(1, dtype=torch.long, device=device)
        _bcast(group, size)
        if int(size.item()) == 0:
            return
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        _bcast(group, raw)
        shard: dict[str, torch.Tensor] = {}
        for dt, entries in json.loads(raw.cpu().numpy().tobytes().decode()):
            numels = [int(np.prod(shape, dtype=np.int64)) for _, shape in entries]
            flat = torch.empty(sum(numels), dtype=getattr(torch, dt), device=device)
            _bcast(group, flat.view(torch.uint8))  # received in place through the byte view
            for (name, shape), piece in zip(entries, flat.split(numels)):
                shard[name] = piece.view(shape)
        yield shard


def _slim(s: RolloutSample) -> RolloutSample:
    """What a reward worker needs of a sample: its text, prompt, response ids and validity (not the pixels
    of the prompt, nor the log-probs)."""
    return replace(s, inputs=PromptInputs(s.inputs.input_ids), rollout_logp=None, old_logp=None, ref_logp=None)


class EventLog:
    """Fault events of the Ray workers: counted per ``component/event``, logged with the running counts and
    appended as JSON lines to ``path`` (when given)."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.counts: Counter[str] = Counter()

    def record(self, component: str, worker: int, event: str, **detail: Any) -> None:
        """Count ``event`` (``died``, ``timeout``, ``restarted``, ``requeued``) of ``component`` worker
        ``worker``, log it and append it to the file."""
        self.counts[f"{component}/{event}"] += 1
        row = {"time": time.time(), "component": component, "worker": worker, "event": event, **detail,
               "counts": dict(self.counts)}
        log.warning("ray %s worker %d: %s %s; counts %s", component, worker, event,
                    " ".join(f"{k}={v}" for k, v in detail.items()), dict(self.counts))
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")


# --------------------------------------------------------------------------------------------- actors
class _HeldState:
    """The driver's run state as the checkpoint code sees it (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, state: Any = None):
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def _seed_everything(seed: int) -> None:
    # as keye.train.rlep.train does before building its components
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class LearnerActor:
    """One learner rank: a :class:`keye.rl.learner.Learner` in its own process, joined with the other ranks
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
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group (``WORLD_SIZE > 1``) and build the learner; returns what the driver's proxy
        exposes (model config, frozen towers, strategy, dtype, reference model presence)."""
        from keye.processing.processor import KeyeProcessor
        from keye.rl.learner import Learner
        from keye.tiny import resolve_model_path
        from keye.train import dist as kdist

        if self.world > 1:
            # one GPU per actor at most (Ray sets CUDA_VISIBLE_DEVICES), so the local device is always 0
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                              WORLD_SIZE=str(self.world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        info = kdist.init_distributed(self.cfg.train.device)
        _seed_everything(self.cfg.train.seed)
        self.learner = Learner(self.cfg, info, model_path=Path(self.model_path))
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


class RolloutActor:
    """A rollout worker: a whole-weight rollout engine (``rollout.engine`` local or vllm) in its own process.

    Every :meth:`generate` names the random state it starts from (``{"seed": s}`` or ``{"state":
    engine.state_dict()}``) and the weight version it expects, and returns the state it ends in, so the
    driver can re-send a request to a replacement worker and get the same samples.
    """

    def __init__(self, cfg: Any, model_path: str, dtype: str, seed: int, threads: int):
        from keye.processing.processor import KeyeProcessor
        from keye.rl.rollout import LocalRollout, VLLMRollout
        from keye.tiny import resolve_model_path
        from keye.train import dist as kdist

        torch.set_num_threads(threads)
        self.sync: tuple[Any, Any] | None = None  # (store, group) of the weight broadcast
        r = cfg.rollout
        info = kdist.init_distributed(cfg.train.device)  # no WORLD_SIZE here: picks the device (and CPU flags)
        cm = cfg.model
        processor = KeyeProcessor.from_pretrained(resolve_model_path(cm.processor or cm.path))
        self.kind = r.engine
        if r.engine == "local":
            from keye.model.keye_vl import KeyeVL

            model = KeyeVL.from_pretrained(model_path, torch_dtype=dtype, attn_implementation=cm.attn_implementation)
            model = model.to(info.device).eval().requires_grad_(False)
            self.engine: Any = LocalRollout(model, processor, max_new_tokens=r.max_new_tokens,
                                            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                            max_batch_size=r.max_batch_size, seed=seed)
        else:
            # the worker owns its GPU: vLLM never sleeps between rollouts here unless asked to
            self.engine = VLLMRollout(model_path, processor, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                      top_p=r.top_p, top_k=r.top_k, seed=seed, colocate=r.colocate)

    def pid(self) -> int:
        """This actor's process id (for operators and fault tests)."""
        return os.getpid()

    def weight_version(self) -> int:
        """The weight version this worker serves."""
        return int(self.engine.weight_version)

    def generate(self, prompts: list[Any], n: int, start: dict[str, Any],
                 version: int) -> tuple[list[RolloutSample], dict[str, Any]]:
        """``n`` samples per prompt from random state ``start`` under weights ``version``; returns them (each
        with ``metadata["weight_version"]``) and the engine state afterwards.

        Raises:
            WorkerProtocolError: the worker does not serve ``version``.
        """
        if int(self.engine.weight_version) != int(version):
            raise WorkerProtocolError(f"rollout worker serves weights {self.engine.weight_version}, the request "
                                      f"expects {version}")
        if "seed" in start:
            self.engine.reseed(int(start["seed"]))
        else:
            self.engine.load_state_dict(start["state"])
        samples = self.engine.generate(prompts, n)
        for s in samples:
            s.metadata["weight_version"] = int(version)
        return samples, self.engine.state_dict()

    def load_weights(self, refs: list[Any], version: int) -> int:
        """Load the shards behind ``refs`` (object refs of ``{name: tensor}``, fetched one at a time) and serve
        ``version`` from now on; returns the number of tensors loaded."""
        return self._load((ray.get(ref) for ref in refs), version)

    def open_sync_group(self, addr: str, port: int, rank: int, world: int, backend: str, timeout_s: float) -> None:
        """Join (as ``rank``) a new weight-broadcast group with learner rank 0."""
        self.sync = None
        self.sync = open_sync_group(addr, port, rank, world, backend, timeout_s)
        self.sync_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def receive_weights(self, version: int) -> int:
        """Load the shards learner rank 0 broadcasts and serve ``version``; returns the number of tensors."""
        return self._load(receive_shards(self.sync[1], self.sync_device), version)

    def _load(self, shards: Iterator[dict[str, torch.Tensor]], version: int) -> int:
        if self.kind == "local":
            return self.engine.load_weights(shards, version=int(version))
        return self.engine.sync_weights(shards, version=int(version))


class RewardActor:
    """A reward worker: ``scorer_factory()`` (a :class:`~keye.rl.scoring.RewardScorer` in the recipe) in its
    own process."""

    def __init__(self, scorer_factory: Callable[[], Any]):
        self.scorer = scorer_factory()

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def score(self, samples: list[RolloutSample]) -> Scores:
        """Score ``samples`` (same order)."""
        return self.scorer(samples)


@dataclass
class RewardScorerFactory:
    """Builds the recipe's :class:`~keye.rl.scoring.RewardScorer` inside a reward worker (picklable)."""

    spec: dict[str, Any]
    pass_value: float

    def __call__(self) -> Any:
        from keye.rewards import RewardSpec
        from keye.rl.scoring import RewardScorer

        return RewardScorer(RewardSpec.from_dict(self.spec), pass_value=self.pass_value)


# --------------------------------------------------------------------------------------------- session
def connect(section: Any) -> bool:
    """Connect to Ray as ``rl.ray`` says; returns whether this call started it (an initialised Ray is kept)."""
    if ray.is_initialized():
        return False
    if section.address is None:
        # "local": always a new cluster of this process, never one a `ray start` left on this machine
        ray.init(address="local", num_cpus=section.num_cpus or os.cpu_count() or 1, include_dashboard=False)
    else:
        ray.init(address=section.address)
    return True


def _release(pg: Any, actors: list[Any]) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or Ray is shutting down
            pass
    actors.clear()
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - Ray is shutting down
            pass


class RaySession:
    """The run's placement group (one bundle per actor: learners, then rollout, then reward workers) and
    every actor started in it. :meth:`close` kills the actors and removes the group; it also runs when the
    session is garbage-collected (the proxies hold it), so a finished run releases its resources.

    Raises:
        KeyeConfigError: the placement group cannot be placed within ``rl.ray.placement_timeout_s``.
    """

    def __init__(self, section: Any, events: EventLog):
        import gc

        self.section, self.events = section, events
        self.started = connect(section)
        gc.collect()  # a finished run's session still awaiting collection releases its resources first
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.learner_gpus = section.learner_gpus if section.learner_gpus is not None else float(has_gpus)
        self.rollout_gpus = section.rollout_gpus if section.rollout_gpus is not None else float(has_gpus)
        kinds = ([("learner", section.learner_cpus, self.learner_gpus)] * section.learners
                 + [("rollout", section.rollout_cpus, self.rollout_gpus)] * section.rollout_workers
                 + [("reward", section.reward_cpus, 0.0)] * section.reward_workers)
        self.bundles = [{"CPU": float(c), **({"GPU": float(g)} if g else {})} for _, c, g in kinds]
        self.first = {"learner": 0, "rollout": section.learners,
                      "reward": section.learners + section.rollout_workers}
        self.resources = {k: (c, g) for k, c, g in kinds}
        self.pg = placement_group(self.bundles, strategy=section.placement)
        self.actors: list[Any] = []
        self._finalizer = weakref.finalize(self, _release, self.pg, self.actors)
        try:
            ray.get(self.pg.ready(), timeout=section.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise KeyeConfigError(
                f"rl.ray: the placement group {self.bundles} ({section.placement}) could not be placed within "
                f"{section.placement_timeout_s} s; the cluster offers {ray.cluster_resources()} (lower "
                "rl.ray.*_cpus / *_gpus or the worker counts, or add nodes)") from None

    def start(self, cls: type, kind: str, index: int, name: str, *args: Any) -> Any:
        """Start actor ``cls(*args)`` in bundle ``index`` of ``kind``'s bundles, named ``name`` (in this
        driver's namespace)."""
        cpus, gpus = self.resources[kind]
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.first[kind] + index)
        handle = ray.remote(cls).options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy, name=name,
                                         max_restarts=0).remote(*args)
        self.actors.append(handle)
        return handle

    def retire(self, handle: Any) -> None:
        """Kill ``handle`` (a dead or hung worker) and forget it."""
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.actors[:] = [a for a in self.actors if a is not handle]

    def close(self) -> None:
        """Kill every actor and remove the placement group (idempotent)."""
        self._finalizer()


# --------------------------------------------------------------------------------------------- learner
@dataclass(frozen=True)
class RemoteModel:
    """Where a model of the learner group lives (the driver holds no weights): ``role`` policy or reference,
    the learner ``strategy`` and the number of ranks."""

    role: str
    strategy: str
    ranks: int


class RemoteLearner:
    """The driver's view of the learner group: the :class:`keye.rl.learner.Learner` interface the recipe's
    loop uses, each call fanned out to every rank (all calls are collective on the actors).

    ``model`` / ``ref_model`` are :class:`RemoteModel` descriptions (``ref_model`` None without a reference
    model); ``config``, ``frozen``, ``strategy``, ``sharded``, ``dtype`` are the ranks' values. Both
    ``rl.mode`` s train with it: the synchronous loop through :func:`build_ray_components`, the asynchronous
    one (:func:`keye.rl.async_loop.train_async`) directly, in a :class:`RaySession` of learner bundles only.
    """

    def __init__(self, session: RaySession, cfg: Any, model_path: Path):
        self.session, self.cfg = session, cfg
        rs = cfg.rl.ray
        threads = _threads(rs.learner_cpus, rs.torch_threads)
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
        for idx, values in zip(shares, ray.get(refs)):
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
        return merge_updates(ray.get(jobs))

    def export_refs(self, max_bytes: int) -> list[Any]:
        """The current weights as object refs of shards ``{name: tensor}`` (each ``ray.put`` once by rank 0,
        owned by the driver; the other ranks walk the collective export alongside)."""
        stream = self.actors[0].export_shards.options(num_returns="streaming").remote(max_bytes)
        drains = [a.drain_export.remote(max_bytes) for a in self.actors[1:]]
        refs = list(stream)
        ray.get(drains)
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
            yield ray.get(ref)

    def save_checkpoint(self, ckpt_dir: Path, run_state: Any, trainer_state: dict[str, Any], processor: Any) -> None:
        """Every rank writes its part of the checkpoint layout of :func:`keye.train.sft.save_checkpoint` (rank 0
        the model export, processor and ``trainer_state.pt``) with the driver's ``run_state`` as the loader
        state (``processor`` is the ranks' own copy of the same files). ``ckpt_dir`` must be reachable from
        learner rank 0 and the driver (same machine or shared storage)."""
        state = run_state.state_dict()
        ray.get([a.save.remote(str(ckpt_dir), state, trainer_state) for a in self.actors])

    def load_checkpoint(self, ckpt_dir: Path, run_state: Any) -> dict[str, Any]:
        """Every rank restores its part; the driver's ``run_state`` gets the saved one. Returns the trainer
        state."""
        out = ray.get([a.load.remote(str(ckpt_dir)) for a in self.actors])
        trainer, held = out[0]
        run_state.load_state_dict(held)
        return trainer

    def checksum(self) -> float:
        """Sum of every weight in float64 (collective over the ranks)."""
        return ray.get([a.checksum.remote() for a in self.actors])[0]

    def pids(self) -> list[int]:
        """The ranks' process ids."""
        return ray.get([a.pid.remote() for a in self.actors])


# --------------------------------------------------------------------------------------------- workers
class _WorkerPool:
    """Replaceable workers of one kind with the fault handling both pools share: a call whose worker died
    (``RayActorError``) - or, with ``timeout``, did not answer in time - gets a new worker (``make(index,
    generation)``, then ``prepare(index, handle)``) and is re-sent, at most ``max_restarts`` times."""

    def __init__(self, session: RaySession, component: str, count: int, make: Callable[[int, int], Any],
                 max_restarts: int, prepare: Callable[[int, Any], None] | None = None):
        self.session, self.component, self.make, self.prepare = session, component, make, prepare
        self.max_restarts = max_restarts
        self.events = session.events
        self.generation = [0] * count
        self.workers = [make(i, 0) for i in range(count)]
        # wait until every worker is built (model loaded): start-up errors surface here, and a call's
        # timeout never includes a worker's start-up
        ray.get([w.pid.remote() for w in self.workers])

    def restart(self, i: int, prepare: bool = True) -> None:
        """Replace worker ``i`` (killing the old one), wait until the new one is up and (``prepare``) prepare it."""
        self.session.retire(self.workers[i])
        self.generation[i] += 1
        self.workers[i] = self.make(i, self.generation[i])
        ray.get(self.workers[i].pid.remote())
        self.events.record(self.component, i, "restarted", generation=self.generation[i])
        if prepare and self.prepare is not None:
            self.prepare(i, self.workers[i])

    def dead(self) -> list[int]:
        """Indices of the workers that do not answer (their process died)."""
        out = []
        for i, w in enumerate(self.workers):
            try:
                ray.get(w.pid.remote())
            except ray.exceptions.RayActorError:
                out.append(i)
        return out

    def run(self, jobs: dict[int, Callable[[Any], Any]], what: str, timeout: float | None = None) -> dict[int, Any]:
        """Submit ``jobs[i](worker_i)`` on every listed worker at once; returns their results by index.

        Raises:
            RayWorkerError: a job failed more than ``max_restarts`` times.
        """
        start = time.monotonic()
        pending = {i: (job(self.workers[i]), start) for i, job in jobs.items()}
        out: dict[int, Any] = {}
        failures = dict.fromkeys(jobs, 0)
        for i in sorted(jobs):
            while i not in out:
                ref, t0 = pending[i]
                try:
                    wait = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
                    out[i] = ray.get(ref, timeout=wait)
                    continue
                except ray.exceptions.GetTimeoutError:
                    event = "timeout"
                    why = f"no answer within {timeout} s"
                except ray.exceptions.RayActorError as err:
                    event = "died"
                    why = type(err).__name__
                failures[i] += 1
                self.events.record(self.component, i, event, call=what, detail=why)
                if failures[i] > self.max_restarts:
                    raise RayWorkerError(f"ray {self.component} worker {i}: {what} failed {failures[i]} times "
                                         f"(last: {why}); rl.ray.max_restarts={self.max_restarts}")
                self._restart_until_up(i, what, failures)
                pending[i] = (jobs[i](self.workers[i]), time.monotonic())
                self.events.record(self.component, i, "requeued", call=what)
        return out

    def _restart_until_up(self, i: int, what: str, failures: dict[int, int]) -> None:
        while True:
            try:
                self.restart(i)
                return
            except ray.exceptions.RayActorError as err:
                failures[i] += 1
                self.events.record(self.component, i, "died", call=f"restart for {what}", detail=type(err).__name__)
                if failures[i] > self.max_restarts:
                    raise RayWorkerError(f"ray {self.component} worker {i} could not be restarted for {what}: "
                                         f"{err}") from None


class RemoteEngine:
    """The driver's rollout engine over ``rl.ray.rollout_workers`` :class:`RolloutActor` s, with the interface
    of :class:`~keye.rl.rollout.LocalRollout` the recipe uses (``generate``, ``reseed``, ``state_dict`` /
    ``load_state_dict``, ``weight_version``) and :meth:`sync_from`.

    The per-worker random states live here (a worker is stateless between calls), so ``state_dict`` needs no
    remote call and a replacement worker continues exactly where the dead one would have.
    """

    def __init__(self, session: RaySession, cfg: Any, model_path: Path, dtype: str, seed: int,
                 broadcast: str | None = None):
        rs = cfg.rl.ray
        self.cfg, self.kind = cfg, cfg.rollout.engine
        self.sync_bytes = cfg.rollout.sync_bytes
        self.weight_version = 0
        self._refs: list[Any] = []  # the shards of weight_version (None of them for the start checkpoint)
        # broadcast weight sync: the backend (nccl / gloo) or None (object store); the learner last synced from
        self.broadcast, self.sync_timeout_s = broadcast, rs.sync_timeout_s
        self._learner: RemoteLearner | None = None
        self._group_ok = False
        n = rs.rollout_workers
        threads = _threads(rs.rollout_cpus, rs.torch_threads)
        # a vLLM engine seeds each call from its construction seed and call count: the count is its state
        self._start: list[dict[str, Any]] = ([{"seed": worker_seed(seed, i)} for i in range(n)] if self.kind == "local"
                                             else [{"state": {"calls": 0}} for _ in range(n)])

        def make(i: int, gen: int) -> Any:
            return session.start(RolloutActor, "rollout", i, f"keye-rollout-{i}-{gen}", cfg, str(model_path), dtype,
                                 worker_seed(seed, i), threads)

        me = weakref.proxy(self)  # no reference cycle: the engine (and its actors) go when the run drops it

        def prepare(i: int, handle: Any) -> None:
            if me.broadcast is not None:
                # a new member: the group is formed again and the current weights broadcast to every worker
                me._group_ok = False
                if me._learner is not None:
                    me._broadcast(me._learner, me.weight_version)
            elif me._refs:  # the start checkpoint is what a new worker holds already
                ray.get(handle.load_weights.remote(me._refs, me.weight_version))

        self.pool = _WorkerPool(session, "rollout", n, make, rs.max_restarts, prepare)

    @property
    def num_workers(self) -> int:
        """How many rollout workers."""
        return len(self.pool.workers)

    def reseed(self, seed: int) -> None:
        """Start every worker's sampling stream from :func:`worker_seed` ``(seed, k)`` at its next call. A vLLM
        engine is not reseeded (as in one process: its seeds come from its call count)."""
        if self.kind == "local":
            self._start = [{"seed": worker_seed(seed, i)} for i in range(self.num_workers)]

    def state_dict(self) -> dict[str, Any]:
        """Every worker's random state (for exact resume)."""
        return {"ray_workers": [dict(s) for s in self._start], "engine": self.kind}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            KeyeConfigError: the state was not written by a Ray engine of the same kind and worker count.
        """
        if "ray_workers" not in state or state.get("engine") != self.kind:
            raise KeyeConfigError(f"the saved rollout state {sorted(state)} was not written by rl.engine=ray with "
                                  f"rollout.engine={self.kind}: resume with the engines the run was started with")
        if len(state["ray_workers"]) != self.num_workers:
            raise KeyeConfigError(f"the checkpoint holds {len(state['ray_workers'])} rollout workers' state; resume "
                                  f"with rl.ray.rollout_workers={len(state['ray_workers'])} (now {self.num_workers})")
        self._start = [dict(s) for s in state["ray_workers"]]

    def generate(self, prompts: Sequence[Any], n: int) -> list[RolloutSample]:
        """``n`` samples per prompt (prompt by prompt, ``group`` = index in ``prompts``); worker ``k`` samples
        the ``k``-th contiguous slice of the prompts."""
        if n < 1:
            raise KeyeConfigError(f"n (rollouts per prompt) must be >= 1, got {n}")
        prompts = list(prompts)
        spans = {k: span for k, span in enumerate(split_even(len(prompts), self.num_workers)) if span[1] > span[0]}
        version = self.weight_version
        jobs = {k: (lambda w, lo=lo, hi=hi, k=k: w.generate.remote(prompts[lo:hi], n, self._start[k], version))
                for k, (lo, hi) in spans.items()}
        results = self.pool.run(jobs, "generate")
        out: list[RolloutSample] = []
        for k in sorted(spans):
            samples, end = results[k]
            self._start[k] = {"state": end}
            for s in samples:
                s.group += spans[k][0]
            out += samples
        return out

    def sync_from(self, learner: RemoteLearner, version: int) -> None:
        """Serve the learner's current weights as ``version`` (between calls: never inside a generation).

        Object store: the shards are put once and every worker loads them; they are kept until the next sync
        (a replacement worker loads them). Broadcast: learner rank 0 broadcasts the shards to every worker in
        their own process group; a replacement worker gets the learner's weights broadcast again (in sync mode
        they are still ``version``'s)."""
        t0 = time.time()
        if self.broadcast is not None:
            self._broadcast(learner, int(version))
            self._learner, self.weight_version = learner, int(version)
        else:
            refs = learner.export_refs(self.sync_bytes)
            self.pool.run({k: (lambda w: w.load_weights.remote(refs, version)) for k in range(self.num_workers)},
                          f"load weights v{version}")
            self._refs, self.weight_version = refs, int(version)
        log.info("weights v%d synced to %d rollout worker(s) by %s in %.2f s", version, self.num_workers,
                 f"{self.broadcast} broadcast" if self.broadcast else "the object store", time.time() - t0)

    def _form_group(self, learner: RemoteLearner) -> None:
        addr, port = ray.get(learner.actors[0].endpoint.remote())
        world, backend, timeout = 1 + self.num_workers, self.broadcast, self.sync_timeout_s
        ray.get([learner.actors[0].open_sync_group.remote(addr, port, world, backend, timeout)]
                + [w.open_sync_group.remote(addr, port, k + 1, world, backend, timeout)
                   for k, w in enumerate(self.pool.workers)])

    def _broadcast(self, learner: RemoteLearner, version: int) -> None:
        """Broadcast the learner's weights to every worker as ``version``; a worker found dead (before, or by a
        failed broadcast) is replaced, the group formed again and the broadcast repeated."""
        failures = 0
        restarted: list[int] = []
        while True:
            for i in self.pool.dead():
                self.pool.events.record("rollout", i, "died", call=f"broadcast v{version}", detail="no answer")
                self.pool.restart(i, prepare=False)
                restarted.append(i)
                self._group_ok = False
            try:
                if not self._group_ok:
                    self._form_group(learner)
                    self._group_ok = True
                calls = learner.broadcast_refs(self.sync_bytes) + [w.receive_weights.remote(version)
                                                                   for w in self.pool.workers]
                ray.wait(calls, num_returns=len(calls))  # every member is out of the collective
                ray.get(calls)
            except ray.exceptions.RayError as err:
                failures += 1
                self._group_ok = False
                log.warning("weight broadcast v%d failed (%s); attempt %d", version, type(err).__name__, failures)
                if failures > self.pool.max_restarts:
                    raise RayWorkerError(f"the weight broadcast v{version} failed {failures} times (last: {err}); "
                                         f"rl.ray.max_restarts={self.pool.max_restarts}") from None
                continue
            for i in restarted:
                self.pool.events.record("rollout", i, "requeued", call=f"broadcast v{version}")
            return

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return ray.get([w.pid.remote() for w in self.pool.workers])


class RemoteScorer:
    """Scores samples on ``rl.ray.reward_workers`` :class:`RewardActor` s (contiguous slices, in parallel);
    a slice whose worker died or took longer than ``timeout_s`` is re-run on a new worker (the scorer is
    deterministic, so the result is the same). Same contract as :class:`~keye.rl.scoring.RewardScorer`."""

    def __init__(self, session: RaySession, factory: Callable[[], Any], workers: int, timeout_s: float,
                 max_restarts: int):
        self.timeout_s = timeout_s

        def make(i: int, gen: int) -> Any:
            return session.start(RewardActor, "reward", i, f"keye-reward-{i}-{gen}", factory)

        self.pool = _WorkerPool(session, "reward", workers, make, max_restarts)

    def __call__(self, samples: Sequence[RolloutSample]) -> Scores:
        """Scores of ``samples`` in order."""
        slim = [_slim(s) for s in samples]
        spans = {k: span for k, span in enumerate(split_even(len(slim), len(self.pool.workers))) if span[1] > span[0]}
        jobs = {k: (lambda w, lo=lo, hi=hi: w.score.remote(slim[lo:hi])) for k, (lo, hi) in spans.items()}
        results = self.pool.run(jobs, "score", timeout=self.timeout_s)
        out = Scores([], [], [])
        for k in sorted(spans):
            part = results[k]
            out.rewards += list(part.rewards)
            out.passed += list(part.passed)
            out.parts += list(part.parts)
        return out

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return ray.get([w.pid.remote() for w in self.pool.workers])


# --------------------------------------------------------------------------------------------- build
def broadcast_backend(weight_sync: str, learner_devices: Sequence[str], rollout_gpus: float) -> str | None:
    """The weight-broadcast backend for ``rl.ray.weight_sync``: None (object store), ``nccl`` (learner rank 0 and
    the rollout workers on GPUs) or ``gloo`` (CPU tensors). ``auto`` broadcasts only when every learner and
    rollout worker has a GPU."""
    on_gpus = all(d.startswith("cuda") for d in learner_devices) and rollout_gpus > 0
    if weight_sync == "object_store" or (weight_sync == "auto" and not on_gpus):
        return None
    return "nccl" if on_gpus else "gloo"


def build_ray_components(cfg: Any, info: Any, model_path: Path, processor: Any) -> Any:
    """The recipe's components on Ray (see the module doc): :class:`RemoteLearner`, :class:`RemoteEngine`,
    no rollout model in the driver, the driver's evaluation copy (with ``eval.manifest``) and a
    :class:`RemoteScorer` (None with ``rl.ray.reward_workers: 0``: the driver scores).

    Raises:
        KeyeConfigError: an invalid ``rl`` section (:func:`check_ray_config`) or resources the cluster cannot
            place.
    """
    from keye.model.keye_vl import KeyeVL
    from keye.rl.components import Components
    from keye.rl.state import step_seed as _step_seed

    check_ray_config(cfg, info.world_size)
    rs = cfg.rl.ray
    events = EventLog(Path(cfg.checkpoint.out_dir) / "ray_events.jsonl")
    session = RaySession(rs, events)
    try:
        learner = RemoteLearner(session, cfg, model_path)
        engine = RemoteEngine(session, cfg, model_path, learner.dtype, _step_seed(cfg.train.seed, 0, 0),
                              broadcast=broadcast_backend(rs.weight_sync, learner.devices, session.rollout_gpus))
        scorer = None
        if rs.reward_workers:
            scorer = RemoteScorer(session, RewardScorerFactory(dict(cfg.reward.spec), cfg.reward.pass_value),
                                  rs.reward_workers, rs.reward_timeout_s, rs.max_restarts)
    except BaseException:
        session.close()
        raise
    eval_model = None
    if cfg.eval.manifest:
        # held-out evaluation runs in the driver on a copy refreshed from the learner's shards
        eval_model = KeyeVL.from_pretrained(model_path, torch_dtype=learner.dtype,
                                            attn_implementation=cfg.model.attn_implementation)
        eval_model = eval_model.to(info.device).eval().requires_grad_(False)
    return Components(learner, engine, None, eval_model, scorer)


__all__ = ["EventLog", "LearnerActor", "broadcast_backend", "broadcast_shards", "open_sync_group",
           "receive_shards", "RaySession", "RayWorkerError", "RemoteEngine", "RemoteLearner",
           "RemoteModel", "RemoteScorer", "RewardActor", "RewardScorerFactory", "RolloutActor", "assign_groups",
           "build_ray_components", "check_ray_config", "connect", "merge_updates", "plan_updates", "split_even",
           "worker_seed"]
