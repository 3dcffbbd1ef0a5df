"""Per-GPU memory of one SFT optimizer step (``keye sft plan``): parameters, gradients and AdamW states per strategy,
the autocast weight copies, the activations of one micro-batch on one rank (split over the context-parallel
group), the chunked loss head, and whether it fits.

The model is what :mod:`keye.sft.model` and :mod:`keye.sft.step` build: with a bf16 checkpoint outside ZeRO the
trainable weights are float32 and autocast computes in bf16 (so gradients and AdamW states are float32, and
autocast keeps one bf16 copy of every trainable Linear / Conv weight until the forward ends: under FSDP2 too, as
each gathered layer's copy stays in autocast's cache); under ZeRO-2/3 the model is bf16 and DeepSpeed keeps float32
master weights, gradients and states in partitions. The loss goes through ``lm_head`` ``loss_chunk_tokens`` target
rows at a time (:mod:`keye.train.loss`): one chunk's logits and their float32 copy, never ``[tokens, vocab]``.
Context parallelism (``train.context_parallel: N``, Ulysses all-to-all over heads) gives each rank ``1/N`` of a
row's tokens and of its vision patches (the vision tower is data-parallel inside the group).

Formulas: ``docs/training.md`` "Planning memory"; ``tests/train/test_sft_plan.py`` checks each item against the
tensors of a real SFT step of a small model on CPU.

Usage::

    from keye.sft.plan import plan_sft_memory
    plan = plan_sft_memory(config, gpus=8, strategy="fsdp2", seq_len=32768, vision_tokens=16384,
                           context_parallel=2, gradient_checkpointing=True)
    print(plan.table())
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from keye.config import KeyeVLConfig
from keye.errors import KeyeConfigError
from keye.train.plan import (
    ADAMW_STATES,
    FP32,
    GiB,
    Item,
    Items,
    ParamCounts,
    activation_bytes,
    check_choice,
    count_parameters,
    dtype_bytes,
)

STRATEGIES = ("ddp", "fsdp2", "zero2", "zero3")
# DeepSpeed's reduce_bucket_size in training/deepspeed/zero{2,3}.json (elements); overlap_comm keeps two buckets
_DS_BUCKET_ELEMENTS = 200_000_000


@dataclass(frozen=True)
class LoraPlan:
    """LoRA adapters as the plan sees them: rank ``r`` on the Linear layers of the ``targets`` towers
    (``llm`` / ``vision``, :data:`keye.train.lora.LORA_TARGETS`); those towers' own weights are frozen."""

    r: int = 16
    targets: tuple[str, ...] = ("llm",)


def _lora_shapes(counts: ParamCounts, lora: LoraPlan) -> list[tuple[str, tuple[int, ...]]]:
    """The adapter parameters ``lora_A`` [r, in] and ``lora_B`` [out, r] of every targeted Linear weight."""
    from keye.train.lora import LORA_TARGETS

    bad = sorted(set(lora.targets) - set(LORA_TARGETS))
    if bad:
        raise KeyeConfigError(f"lora.targets has unknown entries {bad}; use llm and/or vision")
    pattern = re.compile("^(?:" + "|".join(f"(?:{LORA_TARGETS[t]})" for t in lora.targets) + r")\.weight$")
    out = []
    for name, shape, _ in counts.shapes:
        if pattern.match(name):
            base = name.removesuffix(".weight")
            out += [(f"{base}.lora_A", (lora.r, shape[1])), (f"{base}.lora_B", (shape[0], lora.r))]
    return out


def _with_lora(counts: ParamCounts, lora: LoraPlan | None) -> ParamCounts:
    """``counts`` after :func:`keye.train.lora.apply_lora`: the targeted towers frozen, the adapters added
    (trainable, and cast by autocast like any Linear); the per-layer units grow by their adapters."""
    if lora is None:
        return counts
    from keye.train.optim import tower_of

    adapters = _lora_shapes(counts, lora)
    shapes = tuple((n, s, t and tower_of(n) not in lora.targets) for n, s, t in counts.shapes)
    shapes += tuple((n, s, True) for n, s in adapters)
    per_layer: dict[str, int] = {}
    for n, s in adapters:
        layer = n.split(".self_attn")[0].split(".mlp")[0]
        per_layer[layer] = per_layer.get(layer, 0) + math.prod(s)
    dec = max((v for k, v in per_layer.items() if k.startswith("model.layers.")), default=0)
    vis = max((v for k, v in per_layer.items() if k.startswith("visual.")), default=0)
    root_trainable = counts.root_trainable if "llm" not in lora.targets else 0
    return ParamCounts(shapes=shapes, towers=counts.towers, decoder_layer=counts.decoder_layer + dec,
                       vision_layer=counts.vision_layer + vis, root=counts.root, root_trainable=root_trainable,
                       matmul=counts.matmul | {n for n, _ in adapters})


def head_chunk_bytes(config: KeyeVLConfig, *, dtype: str, amp: bool, chunk: int | None, targets: int,
                     head_trainable: bool = True, hidden_tokens: int = 0) -> tuple[int, int]:
    """``(forward, backward)`` peak bytes of the chunked loss head (:func:`keye.train.loss.chunked_cross_entropy`)
    above the activations, for ``targets`` target rows on this rank.

    Forward: one chunk's logits in the compute dtype and their float32 copy (``rows x V x (c + 4)``), plus the
    head cast to the compute dtype under autocast (``V x D x c``). Backward: the head cast again and the head's
    gradient summed in float32 (``4VD``), and the larger of the chunk's float32 logit gradient with its cast
    (``rows x V x (4 + c)``) and, once the float32 one is freed, the cast with one chunk's ``g^T h`` in the compute
    dtype and its float32 copy (``rows x V x c + (c + 4) VD``; in float32 it is accumulated in place). ``c`` is 2
    under autocast (``amp``) or the model dtype's bytes; a bf16 head's float32 sum is cast back at the end (``2VD``).
    ``hidden_tokens``: the forward's final hidden states (``[tokens, D]``, float32 under autocast), alive while the
    loss runs in the forward although autograd does not save them.
    """
    t = config.text
    rows = targets if chunk is None else min(chunk, targets)
    c = 2 if amp else dtype_bytes(dtype)
    vd = t.vocab_size * t.hidden_size
    cast = c * vd if amp else 0
    chunk_fwd = rows * t.vocab_size * (c + FP32) if c != FP32 else rows * t.vocab_size * FP32
    forward = chunk_fwd + cast + (FP32 if amp else c) * t.hidden_size * hidden_tokens
    if not head_trainable:
        return forward, cast + chunk_fwd
    g = rows * t.vocab_size * (FP32 + (c if c != FP32 else 0))
    if c == FP32:
        backward = cast + FP32 * vd + g
    else:
        final_cast = 0 if amp else c * vd  # grad_w.to(weight.dtype): a copy unless the head is float32 (amp)
        backward = cast + FP32 * vd + max(g, rows * t.vocab_size * c + (c + FP32) * vd, final_cast)
    return forward, backward


@dataclass
class SFTMemoryPlan:
    """Per-GPU memory of one SFT step on one rank.

    Attributes:
        items: every line item in bytes per GPU; ``phase`` says when it is alive: ``resident`` (the whole run),
            ``step`` (from the first backward to the optimizer step), ``forward`` (to the end of the forward),
            ``backward`` (during the backward), ``optimizer`` (the optimizer step only).
        forward_bytes / backward_bytes / optimizer_bytes: the peak of each part of the step.
        peak_bytes: the largest of the three; ``fits``: ``peak_bytes <= gpu_bytes``.
        largest: the name of the largest item; ``reason``: the verdict with its margin.
    """

    items: list[Item]
    forward_bytes: int
    backward_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    gpu_bytes: int
    fits: bool
    largest: str
    reason: str
    params: ParamCounts | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def item(self, name: str) -> int:
        """Bytes of the item whose name starts with ``name`` (KeyError if none)."""
        for it in self.items:
            if it.name == name or it.name.startswith(name):
                return it.bytes
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (bytes as integers, plus GiB for reading)."""
        out = {k: getattr(self, k) for k in ("forward_bytes", "backward_bytes", "optimizer_bytes", "peak_bytes",
                                             "gpu_bytes", "fits", "largest", "reason")}
        out["items"] = [{"name": i.name, "bytes": i.bytes, "gib": round(i.bytes / GiB, 3), "phase": i.phase,
                         "note": i.note} for i in self.items]
        out["settings"] = dict(self.settings)
        if self.params is not None:
            out["params"] = {"total": self.params.total, "trainable": self.params.trainable}
        return out

    def table(self) -> str:
        """The plan as a fixed-width text table (GiB per GPU) with the verdict on the last line."""
        s = self.settings
        lora = f"r={s['lora_r']} on {'+'.join(s['lora_targets'])}" if s.get("lora_r") else "off"
        lines = [f"SFT memory plan: {s.get('model', '?')}, {s.get('gpus')} GPU(s) x {self.gpu_bytes / GiB:g} GiB, "
                 f"strategy {s.get('strategy')}, {s.get('dtype')}{' (autocast, fp32 trainable weights)' if s.get('amp') else ''}",
                 f"micro-batch: {s.get('micro_batch')} x {s.get('seq_len')} tokens ({s.get('vision_tokens')} visual, "
                 f"{s.get('answer_tokens')} answer), context parallel {s.get('context_parallel')}, gradient "
                 f"checkpointing {'on' if s.get('gradient_checkpointing') else 'off'}, "
                 f"LoRA {lora}, "
                 f"loss chunk {s.get('loss_chunk_tokens')}"]
        if self.params is not None:
            lines.append(f"parameters: {self.params.total / 1e9:.3f} B total, {self.params.trainable / 1e9:.3f} B trainable")
        lines.append(f"{'item':<60}{'phase':<10}{'GiB/GPU':>9}  note")
        for it in self.items:
            lines.append(f"{it.name:<60}{it.phase:<10}{it.bytes / GiB:>9.2f}  {it.note}".rstrip())
        for name, v in (("forward peak", self.forward_bytes), ("backward peak", self.backward_bytes),
                        ("optimizer step peak", self.optimizer_bytes)):
            lines.append(f"{name:<70}{v / GiB:>9.2f}")
        lines.append(("FITS: " if self.fits else "DOES NOT FIT: ") + self.reason)
        return "\n".join(lines)


def _check(strategy: str, dtype: str, gpus: int, seq_len: int, micro_batch: int, vision_tokens: int,
           answer_tokens: int, context_parallel: int, loss_chunk_tokens: int | None, gpu_memory_gb: float,
           config: KeyeVLConfig, lora: LoraPlan | None) -> None:
    """Raise :class:`KeyeConfigError` naming the first setting the plan cannot take."""
    check_choice("strategy", strategy, STRATEGIES)
    dtype_bytes(dtype)
    for name, v in (("gpus", gpus), ("seq_len", seq_len), ("micro_batch", micro_batch),
                    ("context_parallel", context_parallel)):
        if v < 1:
            raise KeyeConfigError(f"{name} must be >= 1, got {v}")
    if not 0 <= vision_tokens <= seq_len:
        raise KeyeConfigError(f"vision_tokens must be in [0, seq_len={seq_len}], got {vision_tokens}")
    if not 0 <= answer_tokens <= seq_len - vision_tokens:
        raise KeyeConfigError(f"answer_tokens must be in [0, seq_len - vision_tokens = {seq_len - vision_tokens}], "
                              f"got {answer_tokens}")
    if gpus % context_parallel:
        raise KeyeConfigError(f"context_parallel={context_parallel} must divide gpus={gpus} (each group of "
                              f"{context_parallel} ranks shares one row)")
    heads = config.text.num_attention_heads
    if heads % context_parallel:
        raise KeyeConfigError(f"context_parallel={context_parallel} must divide the {heads} attention heads "
                              "(Ulysses all-to-all splits heads over the group)")
    if context_parallel > 1 and strategy not in ("ddp", "fsdp2"):
        raise KeyeConfigError(f"context_parallel={context_parallel} needs strategy ddp or fsdp2, got {strategy} "
                              "(as train.context_parallel)")
    if loss_chunk_tokens is not None and loss_chunk_tokens < 1:
        raise KeyeConfigError(f"loss_chunk_tokens must be >= 1 or None, got {loss_chunk_tokens}")
    if gpu_memory_gb <= 0:
        raise KeyeConfigError(f"gpu_memory_gb must be > 0, got {gpu_memory_gb}")
    if lora is not None and lora.r < 1:
        raise KeyeConfigError(f"lora.r must be >= 1, got {lora.r}")


def plan_sft_memory(
    model_config: KeyeVLConfig,
    *,
    gpus: int,
    seq_len: int,
    strategy: str = "fsdp2",
    dtype: str = "bfloat16",
    micro_batch: int = 1,
    vision_tokens: int = 0,
    answer_tokens: int | None = None,
    context_parallel: int = 1,
    gradient_checkpointing: bool = True,
    lora: LoraPlan | None = None,
    frozen: Sequence[str] = (),
    loss_chunk_tokens: int | None = 512,
    gpu_memory_gb: float = 80.0,
    overhead_gb: float = 1.0,
    model_name: str = "",
    param_counts: ParamCounts | None = None,
) -> SFTMemoryPlan:
    """Plan the per-GPU memory of one SFT optimizer step.

    Args:
        model_config: the model's config; parameters are counted from its real module shapes.
        gpus: ranks of the job (data-parallel x context-parallel); parameters are sharded over all of them.
        seq_len: tokens of one packed row (``data.batch_tokens``); ``micro_batch`` rows per micro-batch.
        strategy: ``ddp`` (replicated), ``fsdp2`` (dim-0 shards), ``zero2`` / ``zero3`` (DeepSpeed partitions).
        dtype: the checkpoint dtype (``model.dtype``); bf16 outside ZeRO trains float32 weights under autocast.
        vision_tokens: merged visual tokens per row (each ``spatial_merge_size^2`` patches in the tower).
        answer_tokens: target tokens per row (default: every text token, ``seq_len - vision_tokens``).
        context_parallel: ranks sharing one row (Ulysses); tokens, patches and targets per rank are ``1/N``.
        gradient_checkpointing: per-layer activation checkpointing in both towers.
        lora: LoRA adapters (:class:`LoraPlan`) or None; frozen: towers without gradients (``train.stage``).
        loss_chunk_tokens: target rows per loss-head chunk (None: all target rows in one chunk).
        gpu_memory_gb / overhead_gb: GPU memory and the assumed CUDA context / NCCL / allocator slack, GiB.
        param_counts: ``count_parameters(model_config, frozen)`` when the caller has it (planning many settings).
    Returns:
        :class:`SFTMemoryPlan`; ``fits`` is False with the largest item named when the peak exceeds the GPU.
    Raises:
        KeyeConfigError: a setting the plan cannot take (unknown strategy, a CP degree that does not divide the
            GPUs or the heads, with a ZeRO strategy, ...).
    """
    answer = seq_len - vision_tokens if answer_tokens is None else answer_tokens
    _check(strategy, dtype, gpus, seq_len, micro_batch, vision_tokens, answer, context_parallel, loss_chunk_tokens,
           gpu_memory_gb, model_config, lora)
    counts = _with_lora(param_counts or count_parameters(model_config, frozen), lora)
    b, cp = dtype_bytes(dtype), context_parallel
    zero = strategy in ("zero2", "zero3")
    amp = b == 2 and dtype == "bfloat16" and not zero
    acc = Items()
    resident = _state_items(acc, counts, strategy=strategy, b=b, amp=amp, gpus=gpus, overhead=int(overhead_gb * GiB))
    step = resident["grads"] + resident["working"]
    # one rank's share of the micro-batch: 1/N of each row's tokens, patches and targets
    m2 = model_config.vision.spatial_merge_size ** 2
    tokens = micro_batch * -(-seq_len // cp)  # each row padded to a multiple of N, then split
    patches = -(-micro_batch * vision_tokens * m2 // cp)
    targets = -(-micro_batch * answer // cp)
    vision_frozen = "vision" in frozen or (lora is not None and "vision" in lora.targets)
    act = activation_bytes(model_config, dtype=dtype, tokens=tokens, sequences=micro_batch, vision_patches=patches,
                           response_tokens=targets, padded=False, gradient_checkpointing=gradient_checkpointing,
                           vision_frozen=vision_frozen, amp=amp)
    batch = f"{tokens} tokens, {patches} patches, {targets} targets per rank"
    ckpt = "with" if gradient_checkpointing else "without"
    saved = acc.add(f"activations saved ({ckpt} checkpointing)", act.saved + _lora_act(model_config, counts, lora, b,
                    tokens, gradient_checkpointing), "step", batch)
    layer_ws = acc.add("backward working set (recompute + grads)", act.backward_peak - act.saved, "backward",
                       "one layer's recomputed tensors and gradients")
    cast = _cast_items(acc, counts, amp=amp, chunked=loss_chunk_tokens is not None, checkpointing=gradient_checkpointing)
    head_fwd, head_bwd = head_chunk_bytes(model_config, dtype=dtype, amp=amp, chunk=loss_chunk_tokens, targets=targets,
                                          head_trainable=any(n == "lm_head.weight" and t for n, _, t in counts.shapes),
                                          hidden_tokens=tokens)
    rows = targets if loss_chunk_tokens is None else min(loss_chunk_tokens, targets)
    acc.add("loss head forward (chunk logits + fp32 copy, head, hidden)", head_fwd, "forward",
            f"{rows} rows x vocab {model_config.text.vocab_size}")
    acc.add("loss head backward (chunk gradient, head gradient in fp32)", head_bwd, "backward",
            "the chunk's logit gradient and its cast, lm_head's gradient summed in float32")
    cp_bytes = _cp_item(acc, model_config, b=b, amp=amp, cp=cp, tokens=tokens, micro_batch=micro_batch,
                        seq_len=seq_len, vision_tokens=vision_tokens)
    opt = acc.add("optimizer step temporaries", resident["opt_tmp"], "optimizer",
                  "foreach AdamW / gradient clipping; after the backward")
    base = resident["resident"] + step + saved + cp_bytes
    # a checkpointed layer's forward holds its MLP-wide intermediates (gate, up, silu, product) until it returns
    transient = 4 * b * model_config.text.intermediate_size * tokens if gradient_checkpointing else 0
    forward = base + cast["forward"] + max(head_fwd, transient)
    backward = base + cast["backward"] + max(head_bwd, layer_ws + cast["layer"])
    optimizer = resident["resident"] + resident["grads"] + opt
    peak = max(forward, backward, optimizer)
    gpu = int(gpu_memory_gb * GiB)
    top = max(acc.items, key=lambda it: it.bytes)
    largest = top.name
    if peak <= gpu:
        margin = f"peak {peak / GiB:.1f} GiB of {gpu_memory_gb:g} GiB; {(gpu - peak) / GiB:.1f} GiB to spare"
    else:
        margin = f"peak {peak / GiB:.1f} GiB, {(peak - gpu) / GiB:.1f} GiB over {gpu_memory_gb:g} GiB"
    reason = f"{margin}; largest item: {largest} ({top.bytes / GiB:.1f} GiB)"
    settings = dict(model=model_name, gpus=gpus, strategy=strategy, dtype=dtype, amp=amp, seq_len=seq_len,
                    micro_batch=micro_batch, vision_tokens=vision_tokens, answer_tokens=answer,
                    context_parallel=cp, gradient_checkpointing=gradient_checkpointing,
                    lora_r=lora.r if lora else 0, lora_targets=list(lora.targets) if lora else [],
                    frozen=list(frozen), loss_chunk_tokens=loss_chunk_tokens, gpu_memory_gb=gpu_memory_gb)
    return SFTMemoryPlan(items=acc.items, forward_bytes=int(forward), backward_bytes=int(backward),
                         optimizer_bytes=int(optimizer), peak_bytes=int(peak), gpu_bytes=gpu, fits=peak <= gpu,
                         largest=largest, reason=reason, params=counts, settings=settings)


def _state_items(acc: Items, counts: ParamCounts, *, strategy: str, b: int, amp: bool, gpus: int,
                 overhead: int) -> dict[str, int]:
    """Parameters, gradients, AdamW states and the strategy's buffers on one rank; returns the ``resident`` bytes,
    the ``grads`` and ``working`` (gathered parameters, buckets) bytes of the step and the optimizer temporaries."""
    w = gpus
    layout = {"fsdp2": "dim0", "zero3": "flat"}.get(strategy, "full")
    note = {"dim0": f"1/{w} of each parameter (dim-0 chunks)", "flat": f"1/{w} flat partitions", "full": "full replica"}

    def held(lay: str, trainable_only: bool) -> int:
        if lay == "dim0":
            return counts.sharded(w, trainable_only=trainable_only)
        if lay == "flat":
            return counts.flat_sharded(w, trainable_only=trainable_only)
        return counts.trainable if trainable_only else counts.total

    trainable = held(layout, True)
    frozen_n = held(layout, False) - trainable
    if strategy in ("zero2", "zero3"):
        part = held("flat", True)  # fp32 master, gradients and states are partitioned
        params = acc.add(f"parameters ({'bf16' if b == 2 else 'fp32'})", b * (trainable + frozen_n), "resident",
                         note[layout])
        master = acc.add("fp32 master weights (DeepSpeed)", FP32 * part if b < FP32 else 0, "resident",
                         f"1/{w} flat partitions")
        states = acc.add("AdamW states (exp_avg, exp_avg_sq; fp32)", ADAMW_STATES * FP32 * part, "resident",
                         f"1/{w} flat partitions")
        grads = acc.add("gradients (fp32 partition)", FP32 * part, "step", f"1/{w} flat partitions")
        if strategy == "zero3":
            unit = max(counts.decoder_layer, counts.vision_layer, *(math.prod(s) for _, s, _ in counts.shapes))
            working = acc.add("ZeRO-3 gathered params (2 largest modules)", 2 * b * unit, "step",
                              "the module running and the one prefetched")
        else:
            working = 0
        working += acc.add("DeepSpeed reduce buckets", 2 * b * min(_DS_BUCKET_ELEMENTS, trainable), "step",
                           "reduce_bucket_size x 2 (overlap_comm)")
        opt_tmp = FP32 * part
        resident = params + master + states
    else:
        pb = FP32 if amp else b  # trainable weights are float32 under autocast
        params = acc.add(f"parameters ({'fp32 trainable + bf16 frozen' if amp else 'fp32' if b == 4 else 'model dtype'})",
                         pb * trainable + b * frozen_n, "resident", note[layout])
        states = acc.add("AdamW states (exp_avg, exp_avg_sq)", ADAMW_STATES * pb * trainable, "resident", note[layout])
        grads = acc.add("gradients", pb * trainable, "step", note[layout] + "; freed after the optimizer step")
        working, buckets = 0, 0
        if strategy == "fsdp2" and gpus > 1:
            unit = max(counts.decoder_layer, counts.vision_layer)
            working = acc.add("FSDP2 all-gathered params (root + 2 layers)", pb * (counts.root + 2 * unit), "step",
                              "root unit gathered through forward+backward; one layer prefetched")
            working += acc.add("FSDP2 unsharded grads (root + 1 layer)", pb * (counts.root_trainable + unit), "step",
                               "before reduce-scatter")
        elif strategy == "ddp" and gpus > 1:
            buckets = acc.add("DDP gradient buckets", pb * trainable, "resident", "a flat copy of every gradient")
        opt_tmp = pb * trainable
        resident = params + states + buckets
    resident += acc.add("CUDA context, NCCL, allocator slack", overhead, "resident", "assumed")
    return {"resident": resident, "grads": grads, "working": working, "opt_tmp": opt_tmp}


def _cast_items(acc: Items, counts: ParamCounts, *, amp: bool, chunked: bool, checkpointing: bool) -> dict[str, int]:
    """Autocast's bf16 copies of the trainable Linear / Conv weights (float32 under autocast). Each is cast once
    per forward and kept in autocast's cache until the forward ends (the chunked loss casts ``lm_head`` itself,
    counted with the head); without checkpointing the Linear layers also save them for the backward, with it one
    layer's copies are made again while it is recomputed."""
    if not amp:
        return {"forward": 0, "backward": 0, "layer": 0}
    skip = {"lm_head.weight", "lm_head.bias"} if chunked else set()
    n = sum(math.prod(s) for name, s, t in counts.shapes if t and name in counts.matmul and name not in skip)
    unit = max(counts.decoder_layer, counts.vision_layer)
    phase = "forward" if checkpointing else "step"
    copies = acc.add("autocast bf16 weight copies", 2 * n, phase,
                     "cache of every trainable Linear/Conv weight until the forward ends" if checkpointing
                     else "cached, then saved by each Linear until its backward")
    return {"forward": copies, "backward": 0 if checkpointing else copies, "layer": 2 * unit if checkpointing else 0}


def _lora_act(config: KeyeVLConfig, counts: ParamCounts, lora: LoraPlan | None, b: int, tokens: int,
              checkpointing: bool) -> int:
    """Bytes LoRA adds to the saved activations: each adapted Linear's ``lora_A`` output (``r`` per token, saved by
    ``lora_B``) in the decoder (the vision adapters' are per patch and smaller); with checkpointing only one layer's
    exist at a time, inside the recompute."""
    if lora is None or "llm" not in lora.targets or checkpointing:
        return 0
    per_layer = sum(1 for n, _, _ in counts.shapes if n.startswith("model.layers.0.") and n.endswith(".lora_A"))
    return b * lora.r * per_layer * tokens * config.text.num_hidden_layers


def _cp_item(acc: Items, config: KeyeVLConfig, *, b: int, amp: bool, cp: int, tokens: int, micro_batch: int,
             seq_len: int, vision_tokens: int) -> int:
    """Context parallelism's extra bytes on a rank (from the layout of docs/training.md §10.6; measured with 2
    gloo ranks by tests/train/test_sft_plan.py): the whole row's input embeddings and 3-D positions, built on every rank before the split, the group's
    vision features all-gathered, and one layer's all-to-all buffers (q, k, v concatenated, received and split into
    contiguous copies, the output sent and received: ``b x tokens x (3 (Q + 2K') + 2Q)``, the KV heads repeated to
    ``lcm(Hkv, N)`` when N does not divide them)."""
    if cp == 1:
        return 0
    t = config.text
    kv_heads = math.lcm(t.num_key_value_heads, cp)
    q, k = t.num_attention_heads * t.head_dim, kv_heads * t.head_dim
    embed_b = FP32 if amp else b
    full = micro_batch * ((embed_b * t.hidden_size + 3 * 8) * seq_len + b * t.hidden_size * vision_tokens)
    # one layer's exchange: q/k/v concatenated to send, received, split into contiguous copies; the output sent back
    # and received
    a2a = b * tokens * (3 * (q + 2 * k) + 2 * q)
    return acc.add("context parallel: full-row embeddings + all-to-all", full + a2a, "step",
                   f"{cp} ranks per row")


__all__ = ["STRATEGIES", "LoraPlan", "SFTMemoryPlan", "head_chunk_bytes", "plan_sft_memory"]
