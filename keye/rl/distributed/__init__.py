"""RL on Ray: the learner group, rollout workers and reward workers as Ray actors behind keye's interfaces.

``keye train rlep --config CFG rl.engine=ray`` runs the same loop as the in-process recipe
(:func:`keye.recipes.rlep.train`); only the components change (:func:`build_ray_components`), returning driver-side
proxies of actors that live anywhere on a Ray cluster:

* :class:`RemoteLearner` - ``rl.ray.learners`` :class:`LearnerActor` s, the ranks of one torch process group
  (gloo on CPU, NCCL on GPU; ``train.strategy`` fsdp2 / zero3 / ddp across them). The driver splits each
  step's groups over the ranks (whole groups) and plans the mini-batches itself, exactly as one process
  would (:func:`plan_updates`), so N ranks compute the one-process update on the same samples (the learner
  is world-invariant: keye/rl/learner/learner.py). Per-rank update statistics are merged token-weighted
  (:func:`merge_updates`).
* :class:`RemoteEngine` - ``rl.ray.rollout_workers`` :class:`RolloutActor` s, each holding a whole-weight
  :class:`~keye.rl.rollout.engines.LocalRollout` (or :class:`~keye.rl.rollout.engines.VLLMRollout` with
  ``rollout.engine: vllm``). Prompts are split by index; worker ``k`` samples from
  :func:`worker_seed` ``(step seed, k)`` (worker 0 from the step seed itself, so one worker samples exactly
  what the in-process engine samples). Every call carries the random state it starts from and the weight
  version it must serve, so a call is a pure function of (weights, state, prompts) and can be re-sent.
* :class:`RemoteScorer` - ``rl.ray.reward_workers`` :class:`RewardActor` s, each holding a
  :class:`~keye.rl.rollout.scoring.RewardScorer`; a share slower than ``rl.ray.reward_timeout_s`` is killed and re-run.

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
running counts and appended to ``<checkpoint.out_dir>/ray_events.jsonl``. The learner group is rebuilt and
resumed from the last checkpoint by the recipe when a rank dies (:class:`~keye.rl.distributed.learner_group.LearnerFailed`).

Starting: ``rl.ray.address`` None starts a local cluster (``ray.init`` with this machine's CPUs and GPUs);
``auto`` (or ``host:port``) joins one started with ``ray start --head`` / ``ray start --address ...``. An
already initialised Ray (a test, a notebook) is used as it is. All actors share one placement group
(``rl.ray.placement``: PACK by default); see docs/rl_ray.md.

This module is imported only with ``rl.engine: ray``: the in-process recipe never imports Ray.
"""
