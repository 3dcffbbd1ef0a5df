"""Per-GPU memory plan of an RL run: the learner (policy, reference, optimizer, activations, log-prob chunks)
and the rollout engine (weights, KV cache), for a model config, a GPU count and a batch.

Every number is computed, none is looked up: parameter counts come from the real module shapes (the
model is built on the meta device), activation bytes from a per-layer count of the tensors autograd saves
in :mod:`keye.model` (see ``docs/rl_memory.md`` for the formulas and what they leave out). The tests in
``tests/rl/test_plan.py`` check the parameter, gradient and optimizer bytes exactly, the FSDP2 shards per
rank, and the activation and log-prob chunk bytes against tensors measured on CPU.

Usage::

    from keye.rl.learner.plan import plan_memory
    plan = plan_memory(config, world_size=8, strategy="fsdp2", dtype="bfloat16", micro_batch_tokens=20480,
                       micro_batch_sequences=4, gradient_checkpointing=True,
                       rollout={"engine": "vllm", "colocated": True, "gpu_memory_utilization": 0.45,
                                "max_num_seqs": 256, "max_model_len": 5120})
    print(plan.fits, plan.reason)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keye.config import KeyeVLConfig
from keye.errors import KeyeConfigError

# the shared pieces live in the training floor (keye sft plan uses them too); re-exported here for existing callers
from keye.train.plan import ADAMW_STATES as _ADAMW_STATES
from keye.train.plan import (
    FP32,
    Activations,
    GiB,
    Item,
    ParamCounts,
    activation_bytes,
    check_choice,
    count_parameters,
    decoder_layer_bytes_per_token,
    dtype_bytes,
    vision_layer_bytes_per_patch,
)
from keye.train.plan import Items as _Items

STRATEGIES = ("fsdp2", "zero3", "ddp")
REF_MODES = ("sharded", "cpu", "none")
ENGINES = ("vllm", "keye")

# The log-softmax chunk holds two float32 [chunk, vocab] buffers at its peak, in the forward (log-probabilities and
# probabilities for the entropy) and in the recomputing backward (the saved log-probabilities and the logits'
# gradient): autograd frees each buffer as soon as its consumer has run. Counted from
# keye.train.logprobs._chunk_stats and measured on CPU by tests/rl/test_plan.py.
_CHUNK_F32_BUFFERS = 2
# per answer token in keye.train.logprobs._LinearLogprobs: float32 lse, entropy and log-prob, int64 row and label
_ANSWER_ROW_BYTES = 3 * FP32 + 2 * 8


def logprob_chunk_bytes(config: KeyeVLConfig, *, dtype: str, chunk: int | None, response_tokens: int) -> int:
    """Peak bytes of the chunked log-softmax's backward (:func:`keye.train.logprobs.chunked_token_logprobs`, the
    ``nn.Linear`` path) above the activations, for ``response_tokens`` answer tokens: the chunk term and the
    answer-length term.

    Chunk: two float32 ``[rows, vocab]`` buffers, ``rows = min(chunk, responses)`` (``chunk=None``: all rows),
    next to the head's gradient summed in float32 (``4VD``); for a 16-bit head, once the float32 buffers are
    freed, one chunk's ``g^T h`` in the head's dtype and its float32 copy (``rows V b + (b + 4) VD``), and at the
    end the float32 sum cast back (``b VD``). Answer length: the hidden rows' gradient (``b D`` per answer token)
    and the per-row float32 log-sum-exp, entropy and log-prob with the int64 row and label indices (28 bytes per
    answer token); the gathered hidden rows themselves are counted with the activations.
    """
    t = config.text
    b, v, vd = dtype_bytes(dtype), t.vocab_size, t.vocab_size * t.hidden_size
    rows = response_tokens if chunk is None else min(chunk, response_tokens)
    buffers = rows * v * FP32 * _CHUNK_F32_BUFFERS
    if b == FP32:
        head = buffers + FP32 * vd
    else:
        head = FP32 * vd + max(buffers, rows * v * b + (b + FP32) * vd, b * vd)
    return head + (b * t.hidden_size + _ANSWER_ROW_BYTES) * response_tokens


# ------------------------------------------------------------------------------------------------- plan
@dataclass
class MemoryPlan:
    """Per-GPU memory of an RL step on one learner rank (and on a rollout GPU when not colocated).

    Attributes:
        items: every line item, bytes per GPU.
        learner_bytes: peak of the learner phase (old/ref log-probs, the update, the optimizer step).
        rollout_bytes: peak of the rollout phase on a learner GPU when colocated, else on a rollout GPU.
        peak_bytes: the larger of the two on the GPU that holds the learner (colocated) or the larger
            requirement of either GPU kind (separate).
        fits: every phase fits ``gpu_bytes`` and the rollout engine can hold one full-length sequence.
        reason: why it fits or not, with the margin in GiB.
        host_items: CPU memory per node (reference offload, sleeping vLLM weights).
        params: the parameter counts the plan used.
        kv: rollout KV-cache facts (bytes per token, tokens the budget holds, full-length sequences).
    """

    items: list[Item]
    learner_bytes: int
    rollout_bytes: int
    peak_bytes: int
    gpu_bytes: int
    fits: bool
    reason: str
    host_items: list[Item] = field(default_factory=list)
    params: ParamCounts | None = None
    kv: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def item(self, name: str) -> int:
        """Bytes of the item called ``name`` (KeyError if absent)."""
        for it in self.items:
            if it.name == name:
                return it.bytes
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bytes as integers, plus GiB for reading)."""
        def row(it: Item) -> dict[str, Any]:
            return {"name": it.name, "bytes": it.bytes, "gib": round(it.bytes / GiB, 3), "phase": it.phase, "note": it.note}

        out = {k: getattr(self, k) for k in ("learner_bytes", "rollout_bytes", "peak_bytes", "gpu_bytes", "fits", "reason")}
        out.update(items=[row(i) for i in self.items], host_items=[row(i) for i in self.host_items],
                   kv=dict(self.kv), settings=dict(self.settings))
        if self.params is not None:
            out["params"] = {"total": self.params.total, "trainable": self.params.trainable, **dict(self.params.towers)}
        return out

    def table(self) -> str:
        """The plan as a fixed-width text table (GiB per GPU)."""
        s = self.settings
        lines = [f"memory plan: {s.get('model', '?')}, {s.get('world_size')} GPU(s) x {self.gpu_bytes / GiB:.0f} GiB, "
                 f"strategy {s.get('strategy')}, {s.get('dtype')}, rollout {s.get('engine')} "
                 f"({'colocated' if s.get('colocated') else 'separate GPUs'})"]
        if self.params is not None:
            lines.append(f"parameters: {self.params.total / 1e9:.3f} B total, {self.params.trainable / 1e9:.3f} B trainable")
        lines.append(f"{'item':<50}{'phase':<9}{'GiB/GPU':>9}  note")
        for it in self.items:
            lines.append(f"{it.name:<50}{it.phase:<9}{it.bytes / GiB:>9.2f}  {it.note}")
        lines.append(f"{'learner phase peak':<59}{self.learner_bytes / GiB:>9.2f}")
        lines.append(f"{'rollout phase peak':<59}{self.rollout_bytes / GiB:>9.2f}")
        for it in self.host_items:
            lines.append(f"host (CPU) memory per node: {it.name}: {it.bytes / GiB:.1f} GiB {it.note}".rstrip())
        if self.kv:
            lines.append(f"rollout KV cache: {self.kv['bytes_per_token'] / 1024:.0f} KiB/token, "
                         f"{self.kv['tokens']:,} tokens = {self.kv['full_sequences']} sequences of {self.kv['max_model_len']} "
                         f"tokens (max_num_seqs {self.kv['max_num_seqs']})")
        lines.append(("FITS: " if self.fits else "DOES NOT FIT: ") + self.reason)
        return "\n".join(lines)


_ROLLOUT_DEFAULTS = {"engine": "vllm", "colocated": True, "gpu_memory_utilization": "auto", "max_num_seqs": 256,
                     "max_model_len": 8192, "max_num_batched_tokens": 8192, "tensor_parallel_size": 1,
                     "kv_cache_dtype": "auto", "gpus": None, "max_batch_size": 64}


def plan_memory(
    model_config: KeyeVLConfig,
    *,
    world_size: int,
    strategy: str = "fsdp2",
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    master_weights: bool = False,
    micro_batch_tokens: int,
    micro_batch_sequences: int = 1,
    vision_patches: int = 0,
    response_tokens: int | None = None,
    padded: bool = True,
    gradient_checkpointing: bool = True,
    logprob_chunk: int | None = 512,
    ref: str = "none",
    frozen: Sequence[str] = (),
    rollout: Mapping[str, Any] | None = None,
    gpu_memory_gb: float = 80.0,
    overhead_gb: float = 1.0,
    model_name: str = "",
) -> MemoryPlan:
    """Plan the per-GPU memory of an RL run (the learner phase and the rollout phase).

    Args:
        model_config: the model's config; parameters are counted from its real module shapes.
        world_size: learner ranks (data-parallel / sharding degree).
        strategy: ``fsdp2`` (parameters, gradients and optimizer states sharded per parameter on dim 0),
            ``zero3`` (DeepSpeed ZeRO-3: flat partitions, float32 master weights) or ``ddp`` (replicated).
        dtype: parameter / activation dtype (``bfloat16``, ``float16``, ``float32``).
        optimizer: ``adamw`` (two states per trainable element).
        master_weights: keep float32 master weights (and float32 gradients and states) next to the
            ``dtype`` compute copy; always on for ``zero3`` with a 16-bit dtype.
        micro_batch_tokens / micro_batch_sequences / vision_patches / response_tokens / padded: one
            micro-batch of the update on one rank (see :func:`activation_bytes`).
        gradient_checkpointing: per-layer activation checkpointing in both towers.
        logprob_chunk: rows per log-softmax chunk (None: unchunked, ``responses x vocab``).
        ref: the reference model ``sharded`` like the policy, offloaded to ``cpu``, or ``none`` (kl_coef 0).
        frozen: towers without gradients (``train.stage``).
        rollout: ``engine`` (``vllm`` | ``keye``), ``colocated`` (vLLM sleeps during training, freeing its
            weights and KV cache), ``gpu_memory_utilization``, ``max_num_seqs``, ``max_model_len``,
            (a fraction, or ``auto``: what the learner leaves when colocated, 0.9 alone),
            ``max_num_batched_tokens``, ``tensor_parallel_size``, ``kv_cache_dtype`` (``auto`` = ``dtype``,
            or ``fp8``), ``gpus`` (rollout GPUs when separate), ``max_batch_size`` (keye engine).
        gpu_memory_gb: memory of one GPU in GiB.
        overhead_gb: CUDA context, NCCL and allocator slack per GPU in GiB (counted in every phase).
    Returns:
        :class:`MemoryPlan` with every item in bytes, the phase peaks and ``fits`` with a reason.
    """
    ro = _check_plan(strategy, optimizer, ref, world_size, micro_batch_tokens, logprob_chunk, gpu_memory_gb, rollout)
    b = dtype_bytes(dtype)
    counts = count_parameters(model_config, frozen)
    gpu = int(gpu_memory_gb * GiB)
    master = master_weights or (strategy == "zero3" and b < FP32)
    acc = _Items()
    state = _resident_state(acc, counts, strategy=strategy, dtype=dtype, master=master, world=world_size, ref=ref,
                            overhead=int(overhead_gb * GiB))
    resp = micro_batch_tokens if response_tokens is None else response_tokens
    act = activation_bytes(model_config, dtype=dtype, tokens=micro_batch_tokens, sequences=micro_batch_sequences,
                           vision_patches=vision_patches, response_tokens=resp, padded=padded,
                           gradient_checkpointing=gradient_checkpointing, vision_frozen="vision" in frozen)
    learner = _learner_phase(acc, state, counts, model_config, act, strategy=strategy, dtype=dtype,
                             logprob_chunk=logprob_chunk, response_tokens=resp,
                             batch=f"{micro_batch_tokens} tokens x {micro_batch_sequences} rows, {vision_patches} patches",
                             checkpointing=gradient_checkpointing)
    colocated = bool(ro["colocated"]) or ro["engine"] == "keye"
    reasons: list[str] = []
    engine_bytes, kv_info = _rollout_phase(acc, ro, model_config, counts, state, strategy=strategy, dtype=dtype,
                                           world=world_size, gpu=gpu, gpu_memory_gb=gpu_memory_gb,
                                           colocated=colocated, reasons=reasons)
    rollout_bytes = state["resident"] + engine_bytes if colocated else engine_bytes + int(overhead_gb * GiB)
    peak = max(learner, rollout_bytes)
    fits, reason = _verdict(learner, rollout_bytes, peak, gpu, gpu_memory_gb, reasons, kv_info, ro,
                            "" if colocated else f" (on {ro['gpus'] or '?'} separate rollout GPU(s))")
    settings = dict(model=model_name, world_size=world_size, strategy=strategy, dtype=dtype, master_weights=master,
                    micro_batch_tokens=micro_batch_tokens, micro_batch_sequences=micro_batch_sequences,
                    vision_patches=vision_patches, response_tokens=resp, gradient_checkpointing=gradient_checkpointing,
                    logprob_chunk=logprob_chunk, ref=ref, frozen=list(frozen), gpu_memory_gb=gpu_memory_gb,
                    colocated=colocated, **{k: v for k, v in ro.items() if k != "colocated"})
    return MemoryPlan(items=acc.items, learner_bytes=int(learner), rollout_bytes=int(rollout_bytes),
                      peak_bytes=int(peak), gpu_bytes=gpu, fits=fits, reason=reason, host_items=acc.host,
                      params=counts, kv=kv_info, settings=settings)


def _check_plan(strategy: str, optimizer: str, ref: str, world_size: int, micro_batch_tokens: int,
                logprob_chunk: int | None, gpu_memory_gb: float, rollout: Mapping[str, Any] | None) -> dict[str, Any]:
    """Raise :class:`KeyeConfigError` for an argument :func:`plan_memory` cannot plan; returns the rollout
    settings with their defaults."""
    check_choice("strategy", strategy, STRATEGIES)
    check_choice("optimizer", optimizer, ("adamw",))
    check_choice("ref", ref, REF_MODES)
    if world_size < 1:
        raise KeyeConfigError(f"world_size must be >= 1, got {world_size}")
    if micro_batch_tokens < 1:
        raise KeyeConfigError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if logprob_chunk is not None and logprob_chunk < 1:
        raise KeyeConfigError(f"logprob_chunk must be >= 1 or None, got {logprob_chunk}")
    if gpu_memory_gb <= 0:
        raise KeyeConfigError(f"gpu_memory_gb must be > 0, got {gpu_memory_gb}")
    unknown = sorted(set(rollout or {}) - set(_ROLLOUT_DEFAULTS))
    if unknown:
        raise KeyeConfigError(f"rollout has unknown key(s) {unknown}; known: {sorted(_ROLLOUT_DEFAULTS)}")
    ro = {**_ROLLOUT_DEFAULTS, **(rollout or {})}
    check_choice("rollout.engine", ro["engine"], ENGINES)
    if ro["gpu_memory_utilization"] != "auto" and not 0 < float(ro["gpu_memory_utilization"]) <= 1:
        raise KeyeConfigError(f"rollout.gpu_memory_utilization must be in (0, 1] or 'auto', got {ro['gpu_memory_utilization']!r}")
    return ro


def _resident_state(acc: _Items, counts: ParamCounts, *, strategy: str, dtype: str, master: bool, world: int,
                    ref: str, overhead: int) -> dict[str, Any]:
    """What stays on a learner GPU in both phases (parameters, master weights, AdamW states, a sharded reference,
    the runtime overhead); returns the shard sizes the learner phase needs and ``resident`` bytes."""
    b, w = dtype_bytes(dtype), world
    state_b = FP32 if master else b  # gradients and AdamW states follow the master copy's dtype
    if strategy == "fsdp2":
        shard, shard_t = counts.sharded(w), counts.sharded(w, trainable_only=True)
        note = f"1/{w} of each parameter (dim-0 chunks)"
    elif strategy == "zero3":
        shard, shard_t = counts.flat_sharded(w), counts.flat_sharded(w, trainable_only=True)
        note = f"1/{w} flat partitions"
    else:
        shard, shard_t = counts.total, counts.trainable
        note = "full replica"
    if strategy == "fsdp2" and master:
        # FSDP2 mixed precision: the sharded parameter *is* the float32 master; compute copies are gathered in dtype
        params = acc.add("policy parameters (fp32 master shard)", FP32 * shard, "both", note)
    else:
        params = acc.add(f"policy parameters ({dtype})", b * shard, "both", note)
        if master:
            params += acc.add("fp32 master weights", FP32 * shard_t, "both", note)
    optim = acc.add("AdamW states (exp_avg, exp_avg_sq)", _ADAMW_STATES * state_b * shard_t, "both", note)
    ref_bytes = 0
    if ref == "sharded":
        ref_n = counts.sharded(w) if strategy == "fsdp2" else counts.flat_sharded(w) if strategy == "zero3" else counts.total
        ref_bytes = acc.add(f"reference parameters ({dtype})", b * ref_n, "both", note)
    elif ref == "cpu":
        copies = w if strategy == "ddp" else 1  # sharded offload: the node's ranks hold one copy between them
        acc.host.append(Item("reference model offloaded", b * counts.total * copies, "both",
                             f"({copies} cop{'y' if copies == 1 else 'ies'})"))
    ovh = acc.add("CUDA context, NCCL, allocator slack", overhead, "both", "assumed")
    return {"resident": params + optim + ref_bytes + ovh, "state_b": state_b, "shard_t": shard_t, "note": note}


def _learner_phase(acc: _Items, state: dict[str, Any], counts: ParamCounts, model_config: KeyeVLConfig,
                   act: Activations, *, strategy: str, dtype: str, logprob_chunk: int | None, response_tokens: int,
                   batch: str, checkpointing: bool) -> int:
    """The update's items (gradients, gathered parameters, activations, the log-prob chunk, optimizer
    temporaries); returns the learner phase's peak bytes."""
    b, state_b, shard_t, note = dtype_bytes(dtype), state["state_b"], state["shard_t"], state["note"]
    grads = acc.add("gradients", state_b * shard_t, "learner", note + "; freed after the optimizer step")
    if strategy == "fsdp2":
        unit = max(counts.decoder_layer, counts.vision_layer)
        gathered = acc.add("FSDP2 all-gathered params (root + 2 layers)", b * (counts.root + 2 * unit), "learner",
                           "root unit stays gathered through forward+backward; one layer prefetched")
        unsharded_grads = acc.add("FSDP2 unsharded grads (root + 1 layer)", b * (counts.root_trainable + unit),
                                  "learner", "before reduce-scatter")
        working = gathered + unsharded_grads
    elif strategy == "zero3":
        unit = max(counts.decoder_layer, counts.vision_layer, *(math.prod(s) for _, s, _ in counts.shapes))
        working = acc.add("ZeRO-3 gathered params + buckets (2 largest modules)", 2 * b * unit + 2 * b * unit,
                          "learner", "gathered modules and reduce/prefetch buckets; bounded by stage3 bucket settings")
    else:
        working = 0
    ckpt = "with" if checkpointing else "without"
    acc.add(f"activations saved ({ckpt} checkpointing)", act.saved, "learner", batch)
    acc.add("backward working set (recompute + grads)", act.backward_peak - act.saved, "learner")
    chunk = acc.add("log-prob head (chunk x vocab, answer rows)", logprob_chunk_bytes(model_config, dtype=dtype, chunk=logprob_chunk,
                                                                          response_tokens=response_tokens),
                    "learner", f"chunk {logprob_chunk}, vocab {model_config.text.vocab_size}, {response_tokens} answer tokens")
    update_peak = state["resident"] + grads + working + act.backward_peak + chunk
    # optimizer step: activations are gone; foreach AdamW makes one temporary the size of the states it updates,
    # explicit data-parallel averaging one flat copy of the gradients
    step = acc.add("optimizer step temporaries", state_b * shard_t, "learner",
                   "foreach AdamW / flat all-reduce; after the backward")
    return max(update_peak, state["resident"] + grads + step)


def _rollout_phase(acc: _Items, ro: dict[str, Any], model_config: KeyeVLConfig, counts: ParamCounts,
                   state: dict[str, Any], *, strategy: str, dtype: str, world: int, gpu: int, gpu_memory_gb: float,
                   colocated: bool, reasons: list[str]) -> tuple[int, dict[str, Any]]:
    """The rollout engine's items (vLLM weights, buffers and KV cache, or keye's own decode loop); returns the
    engine's bytes and the KV-cache figures (``ro["gpu_memory_utilization"]`` resolved, reasons appended)."""
    t, b = model_config.text, dtype_bytes(dtype)
    tp = int(ro["tensor_parallel_size"])
    kv_b = 1 if str(ro["kv_cache_dtype"]).startswith("fp8") else b
    kv_per_token = 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * kv_b // tp
    max_len, max_seqs = int(ro["max_model_len"]), int(ro["max_num_seqs"])
    kv_info: dict[str, Any] = {"bytes_per_token": kv_per_token, "max_model_len": max_len, "max_num_seqs": max_seqs}
    if ro["engine"] != "vllm":
        # the policy's own decode loop: the learner's parameters (gathered layer by layer when sharded), a KV
        # cache of max_batch_size sequences of max_model_len in dtype, and the float32 logits of the batch
        nb = int(ro["max_batch_size"])
        kv_bytes = nb * max_len * (2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * b)
        kv_info.update(tokens=nb * max_len, full_sequences=nb, wanted_tokens=nb * max_len)
        acc.add("keye decode KV cache", kv_bytes, "rollout", f"{nb} seqs x {max_len} tokens")
        gathered_r = b * (counts.root + 2 * max(counts.decoder_layer, counts.vision_layer)) if strategy != "ddp" else 0
        acc.add("keye decode gathered params + logits", gathered_r + nb * t.vocab_size * FP32 * 2, "rollout")
        return kv_bytes + gathered_r + nb * t.vocab_size * FP32 * 2, kv_info
    weights = b * counts.total // tp
    util = ro["gpu_memory_utilization"]
    if util == "auto":
        # colocated: everything the learner keeps during the rollout is already on the GPU when vLLM starts,
        # so it may take the rest (in steps of 0.05); alone on a GPU: vLLM's default
        util = math.floor(20 * (gpu - state["resident"]) / gpu) / 20 if colocated else 0.9
        if util <= 0:
            raise KeyeConfigError(f"gpu_memory_utilization=auto: the learner's resident state "
                                  f"({state['resident'] / GiB:.1f} GiB) leaves no room for vLLM on a "
                                  f"{gpu_memory_gb:g} GiB GPU")
    util = float(util)
    ro["gpu_memory_utilization"] = util
    budget = int(util * gpu)
    # the forward of one scheduler step (max_num_batched_tokens through one layer at a time) and the
    # sampler's float32 logits and probabilities of every running sequence
    d, f = t.hidden_size, t.intermediate_size
    q, k = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    fwd = int(ro["max_num_batched_tokens"]) * b * (2 * d + 3 * f + q + 2 * k) // tp
    sampler = max_seqs * t.vocab_size * 2 * FP32
    kv_tokens = max(0, (budget - weights - fwd - sampler) // kv_per_token)
    kv_bytes = kv_tokens * kv_per_token
    kv_info.update(tokens=int(kv_tokens), full_sequences=int(kv_tokens // max_len), wanted_tokens=max_len * max_seqs)
    acc.add(f"vLLM weights ({dtype}, tp {tp})", weights, "rollout", "freed by sleep() while training" if colocated else "")
    acc.add("vLLM forward + sampler buffers", fwd + sampler, "rollout",
            f"{ro['max_num_batched_tokens']} batched tokens, {max_seqs} seqs x vocab fp32")
    acc.add("vLLM KV cache (rest of gpu_memory_utilization)", kv_bytes, "rollout",
            f"2 x {t.num_hidden_layers} layers x {t.num_key_value_heads} kv heads x {t.head_dim} x {kv_b} B per token")
    if budget < weights + fwd + sampler + max_len * kv_per_token:
        reasons.append(f"vLLM budget {util:.2f} x {gpu_memory_gb:g} GiB = {budget / GiB:.1f} GiB cannot hold the "
                       f"weights, buffers and one {max_len}-token sequence's KV cache "
                       f"({(weights + fwd + sampler + max_len * kv_per_token) / GiB:.1f} GiB)")
    if colocated:
        acc.host.append(Item("vLLM weights while asleep (level 1 offload)", weights * world, "learner", f"({world} engines)"))
    return max(budget, weights + fwd + sampler), kv_info


def _verdict(learner: int, rollout_bytes: int, peak: int, gpu: int, gpu_memory_gb: float, reasons: list[str],
             kv_info: dict[str, Any], ro: dict[str, Any], rollout_gpu_note: str) -> tuple[bool, str]:
    """Whether both phases fit one GPU, and why (or why not)."""
    if learner > gpu:
        reasons.append(f"learner phase needs {learner / GiB:.1f} GiB, {(learner - gpu) / GiB:.1f} GiB over {gpu_memory_gb:g} GiB")
    if rollout_bytes > gpu:
        reasons.append(f"rollout phase{rollout_gpu_note} needs {rollout_bytes / GiB:.1f} GiB, "
                       f"{(rollout_bytes - gpu) / GiB:.1f} GiB over {gpu_memory_gb:g} GiB")
    if reasons:
        return False, "; ".join(reasons)
    reason = (f"learner {learner / GiB:.1f} GiB, rollout{rollout_gpu_note} {rollout_bytes / GiB:.1f} GiB of "
              f"{gpu_memory_gb:g} GiB; {(gpu - peak) / GiB:.1f} GiB to spare")
    if ro["engine"] == "vllm" and kv_info["full_sequences"] < int(ro["max_num_seqs"]):
        reason += (f"; the KV cache holds {kv_info['full_sequences']} of max_num_seqs {ro['max_num_seqs']} full-length "
                   "sequences (vLLM queues or preempts the rest)")
    return True, reason


__all__ = ["ParamCounts", "count_parameters", "decoder_layer_bytes_per_token", "vision_layer_bytes_per_patch",
           "Activations", "activation_bytes", "logprob_chunk_bytes", "Item", "MemoryPlan", "plan_memory",
           "dtype_bytes", "GiB"]
