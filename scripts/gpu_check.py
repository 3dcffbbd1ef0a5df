#!/usr/bin/env python
"""Checks that need a CUDA GPU, run by hand on a GPU host; prints one PASS / FAIL / SKIP row per check.

Usage::

    python scripts/gpu_check.py                      # every check that can run here
    python scripts/gpu_check.py --only golden memory
    python scripts/gpu_check.py --model /ckpt/Keye-VL-1_5-8B --json gpu_check.json   # + the vLLM row

Checks (``--only`` names):

* ``golden``: the golden tiny Keye-VL-8B-Preview (``tests/fixtures/golden/keye_preview_tiny``, outputs of the
  official implementation in float32) on the GPU. float32 (TF32 off) must match within 1e-4 max abs (the CPU
  tests hold 5e-5; GPU reductions add order differences). bfloat16 must stay within a relative L2 error of
  ``8u = 2^-5`` (``u = 2^-8``, bf16's unit roundoff) and 0.15 max abs: every weight and activation stored in bf16
  carries up to u/2 relative error; on CPU this model measures 0.0125 (3.2u) relative and 0.07 max abs
  (logits up to 4.2) against the fp32 goldens, so 2.5x headroom covers other kernels and accumulation orders
  while a real precision bug (an fp32-only op such as RoPE or RMSNorm run in bf16, a wrong cast) shows as
  errors of order 1.
* ``flash``: the vision tower (several images per batch: variable-length segments) with
  ``flash_attention_2`` (flash-attn's varlen kernel) against ``sdpa``, both bf16, relative L2 <= 4u (both
  accumulate in fp32 and round their outputs to bf16). Skipped without the ``flash_attn`` package.
* ``context``: context parallelism on a long packed row (16,384 tokens: a 32-frame Keye-VL-1.5 video and text
  samples; :mod:`keye.train.context_parallel`) with ``flash_attention_2`` in bf16: two ranks (NCCL on two GPUs;
  on one GPU both ranks share it over gloo, which stages the all-to-alls through host memory) split the row, and
  the summed loss and every gradient (all-reduced over the two ranks) are compared with one rank's whole-row
  forward and backward with the same kernel, for KV heads split (2 per rank) and repeated (1 KV head). Bound:
  relative error of the loss and relative L2 of the gradients <= 8u, the golden bf16 row's (both sides round the
  same bf16 activations; only matmul shapes, hence accumulation orders, differ; a wrong split is off by order 1).
  The same comparison with ``sdpa`` is printed beside it as the rounding baseline (the bound was set without a
  GPU to calibrate it on). Skipped without the ``flash_attn`` package.
* ``vllm``: a :class:`keye.rl.VLLMRollout` (vLLM, ``processed_logprobs``) samples a few text and image prompts
  from ``--model``; the learner (:func:`keye.train.logprobs.token_logprobs`, bf16) scores the same tokens; the
  mean absolute difference of the log-probs must be <= ``--max-logp-diff`` (0.05: the rollout/learner mismatch
  that the truncated importance-sampling correction is for is typically a few 1e-2 in bf16); also printed: the
  largest difference and the fraction of tokens whose importance weight would be capped at 2. Skipped without
  ``vllm`` or ``--model``.
* ``memory``: one learner step (forward with chunked log-probs + entropy, backward, AdamW step; bf16, one GPU,
  no sharding) of a mid-size Keye-VL-1.5 config, peak ``torch.cuda.max_memory_allocated`` against
  :func:`keye.rl.learner.plan.plan_memory`'s learner phase (CUDA context excluded): the plan must not be below the
  measurement (2 % slack for allocator rounding) nor above 1.3x of it, with and without gradient
  checkpointing.
* ``sft_memory``: an SFT optimizer step (:func:`keye.sft.step.optimizer_step`, the second of two, two
  micro-batches: bf16 autocast over float32 trainable weights as the recipe loads them, the chunked loss, AdamW) of
  the same mid-size config on a packed 4,096-token row with an image, peak ``torch.cuda.max_memory_allocated`` against
  :func:`keye.sft.plan.plan_sft_memory`'s peak (no overhead line): planned / measured in [0.98, 1.3], with and
  without gradient checkpointing.

Exit status: 0 when nothing failed, 1 when a check failed, 2 without CUDA ("needs CUDA").
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "fixtures" / "golden" / "keye_preview_tiny"
BF16_U = 2.0**-8  # bfloat16 unit roundoff (8 significand bits)
CHECKS = ("golden", "flash", "context", "memory", "sft_memory", "vllm")


@dataclass
class Row:
    """One line of the report: ``status`` is PASS, FAIL or SKIP; ``value`` what was measured, ``limit`` the bound."""

    check: str
    status: str
    value: str = ""
    limit: str = ""
    note: str = ""


def _status(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ------------------------------------------------------------------------------------------------- golden
def _golden_cases() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    cases = json.loads((GOLDEN / "cases.json").read_text())["model_cases"]
    return (cases, load_file(str(GOLDEN / "inputs.safetensors")), load_file(str(GOLDEN / "processor.safetensors")),
            load_file(str(GOLDEN / "expected.safetensors")))


def _golden_kwargs(case: dict[str, Any], inputs: dict[str, Any], proc: dict[str, Any]) -> dict[str, Any]:
    """The forward keyword arguments of one golden model case (cases.json names where each comes from)."""
    kw = {}
    for name, src in case["inputs"].items():
        if isinstance(src, dict):
            import torch

            kw[name] = torch.cat([proc[k] for k in src["concat_from_processor"]])
        elif src is not None and "all ones" not in src:
            kw[name] = inputs[src]
    key = f"{case['name']}/second_per_grid_ts"
    if case.get("fps") is not None and "video_grid_thw" in kw and "second_per_grid_ts" not in kw and key in inputs:
        kw["second_per_grid_ts"] = inputs[key]
    return kw


def check_golden(device: str, dtype_name: str, only: tuple[str, ...] = ()) -> Row:
    """Logits of every golden model case (or the cases named in ``only``) in ``dtype_name`` on ``device``
    against the fp32 goldens."""
    import torch

    from keye import KeyeVL

    dtype = getattr(torch, dtype_name)
    model = KeyeVL.from_pretrained(GOLDEN, torch_dtype=dtype_name, device=device).eval()
    cases, inputs, proc, expected = _golden_cases()
    cases = [c for c in cases if not only or c["name"] in only]
    worst_rel = worst_abs = 0.0
    worst_case = ""
    for case in cases:
        kw = _golden_kwargs(case, inputs, proc)
        kw = {k: v.to(device=device, dtype=dtype) if k.startswith("pixel_values") else v.to(device) for k, v in kw.items()}
        with torch.no_grad():
            logits = model(**kw).logits.float().cpu()
        ref = expected[f"{case['name']}/logits"]
        mask = kw.get("attention_mask")
        if mask is not None:
            sel = mask.bool().cpu()
            logits, ref = logits[sel], ref[sel]
        diff = logits - ref
        rel, mx = float(diff.norm() / ref.norm()), float(diff.abs().max())
        if rel >= worst_rel:
            worst_rel, worst_case = rel, case["name"]
        worst_abs = max(worst_abs, mx)
    del model
    if dtype_name == "float32":
        ok, limit = worst_abs <= 1e-4, "max abs <= 1e-4"
    else:
        ok, limit = worst_rel <= 8 * BF16_U and worst_abs <= 0.15, f"rel L2 <= {8 * BF16_U:.4f}, max abs <= 0.15"
    return Row(f"golden parity {dtype_name} ({len(cases)} cases)", _status(ok),
               f"rel L2 {worst_rel:.2e} ({worst_case}), max abs {worst_abs:.2e}", limit)


# -------------------------------------------------------------------------------------------------- flash
def check_flash_vision(device: str) -> Row:
    """The vision tower's output with flash-attn varlen against sdpa (bf16), on the golden images and video."""
    import torch

    from keye import KeyeVL
    from keye.model.attention import flash_attn_available

    name = "flash-attn varlen vs sdpa vision (bf16)"
    if not flash_attn_available():
        return Row(name, "SKIP", note="flash_attn is not installed (pip install 'keye[gpu]')")
    model = KeyeVL.from_pretrained(GOLDEN, torch_dtype="bfloat16", device=device).eval()
    cases, inputs, proc, _ = _golden_cases()
    worst, segments = 0.0, 0
    for case in cases:
        kw = _golden_kwargs(case, inputs, proc)
        for pix, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if pix not in kw:
                continue
            grids = [tuple(r) for r in kw[grid].tolist()]
            x = kw[pix].to(device=device, dtype=torch.bfloat16)
            outs = []
            for backend in ("sdpa", "flash_attention_2"):
                model.set_attn_implementation(backend)
                with torch.no_grad():
                    outs.append(model.visual(x, grids).float())
            worst = max(worst, float((outs[1] - outs[0]).norm() / outs[0].norm()))
            segments += len(grids)
    model.set_attn_implementation("sdpa")
    del model
    return Row(name, _status(worst <= 4 * BF16_U), f"rel L2 {worst:.2e} over {segments} segments",
               f"<= {4 * BF16_U:.4f}")


# ------------------------------------------------------------------------------------------ context parallel
def _cp_case(dist, cp, device, *, kv_heads: int, backend: str) -> dict[str, float]:
    """One whole-row forward/backward and the same row split over the group; relative differences."""
    import torch

    from keye.config import TextConfig, tiny_config
    from keye.model.keye_vl import KeyeVL
    from keye.testing.long_row import long_video_row
    from keye.train.loss import LossRequest

    text = TextConfig(vocab_size=520, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=64, mrope_section=(8, 12, 12))
    config = tiny_config("1.5", text=text)
    torch.manual_seed(0)
    model = KeyeVL(config).to(device=device, dtype=torch.bfloat16).train()
    model.set_attn_implementation(backend)
    model.always_run_vision = True
    row = long_video_row(config, frames=32, frame_grid=(16, 16), text_lens=(4096, 4096, 4096, 1492), answer=512)
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in row.items()
              if k in ("input_ids", "labels", "seq_lens", "pixel_values_videos", "video_grid_thw")}
    inputs["pixel_values_videos"] = inputs["pixel_values_videos"].to(torch.bfloat16)

    def run(**kw):
        model.zero_grad(set_to_none=True)
        loss = model(**inputs, loss_reduction="sum", loss_request=LossRequest(), **kw).loss
        loss.backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        return loss.detach().float(), grads

    ref_loss, ref_grads = run()
    loss, grads = run(context_parallel=cp)
    both = torch.cat([loss.view(1), grads]).cpu()
    dist.all_reduce(both, group=cp.group)
    return {"tokens": row["num_tokens"], "loss": float((both[0] - ref_loss.cpu()).abs() / ref_loss.abs().cpu()),
            "grads": float((both[1:] - ref_grads.cpu()).norm() / ref_grads.cpu().norm())}


def _cp_worker(out: str) -> int:
    """One rank of the ``context`` check (under torchrun): rank 0 writes every case's errors to ``out``."""
    import os

    import torch
    import torch.distributed as dist

    from keye.train.context_parallel import ContextParallel

    two = torch.cuda.device_count() >= 2
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank if two else 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl" if two else "gloo")
    try:
        cp = ContextParallel.create(2, rank, 2, num_heads=8)
        results = {f"{backend} kv{kv}": _cp_case(dist, cp, device, kv_heads=kv, backend=backend)
                   for backend in ("flash_attention_2", "sdpa") for kv in (4, 1)}
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def check_context_parallel(device: str) -> Row:
    """Context parallelism (2 ranks) with flash-attn varlen on a 16,384-token row against the whole-row run."""
    import subprocess
    import tempfile

    from keye.model.attention import flash_attn_available

    name = "context parallel 2 vs 1, flash-attn varlen (bf16)"
    if not flash_attn_available():
        return Row(name, "SKIP", note="flash_attn is not installed (pip install 'keye[gpu]')")
    del device  # the ranks take cuda:0 (one GPU, shared over gloo) or cuda:0 / cuda:1 (NCCL)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cp.json"
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               __file__, "--cp-worker", str(out)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return Row(name, "FAIL", note=f"the 2-rank run failed: {proc.stderr.strip()[-600:]}")
        res = json.loads(out.read_text())
    flash = {k: v for k, v in res.items() if k.startswith("flash")}
    worst = max(max(v["loss"], v["grads"]) for v in flash.values())
    sdpa = max(max(v["loss"], v["grads"]) for k, v in res.items() if k.startswith("sdpa"))
    tokens = next(iter(res.values()))["tokens"]
    return Row(name, _status(worst <= 8 * BF16_U), f"worst rel {worst:.2e} (sdpa {sdpa:.2e}), {tokens} tokens",
               f"<= {8 * BF16_U:.4f}", note="KV heads split and repeated")


# ------------------------------------------------------------------------------------------------- memory
def _memory_config(layers: int):
    from keye.config import KeyeVLConfig, TextConfig, VisionConfig

    text = TextConfig(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, mrope_section=(8, 12, 12))
    vision = VisionConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                          image_size=224, patch_size=14)
    return KeyeVLConfig(variant="1.5", text=text, vision=vision, bos_token_id=32000, eos_token_id=32001,
                        vision_start_token_id=32002, vision_end_token_id=32003, vision_token_id=32004,
                        image_token_id=32005, video_token_id=32006, torch_dtype="bfloat16")


def _learner_step_peak(config, device: str, *, rows: int, length: int, response: int, grid: tuple[int, int, int],
                       checkpointing: bool, chunk: int) -> int:
    """Peak allocated bytes of one bf16 learner step: forward with chunked log-probs + entropy, backward, AdamW."""
    import torch

    from keye.model.keye_vl import KeyeVL
    from keye.train.logprobs import token_logprobs

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = KeyeVL(config).to(device=device, dtype=torch.bfloat16).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    g = torch.Generator().manual_seed(1)
    prompt = length - response
    n_img = grid[1] * grid[2] // 4
    ids = torch.randint(0, 30000, (rows, prompt), generator=g)
    ids[:, 4:4 + n_img] = config.image_token_id
    batch = {"input_ids": ids.to(device), "attention_mask": torch.ones(rows, prompt, dtype=torch.long, device=device),
             "pixel_values": torch.randn(rows * grid[1] * grid[2], 3, 14, 14, generator=g).to(device, torch.bfloat16),
             "image_grid_thw": torch.tensor([list(grid)] * rows, device=device)}
    responses = torch.randint(0, 30000, (rows, response), generator=g).to(device)
    out = token_logprobs(model, batch, responses, chunk_size=chunk, with_entropy=True)
    loss = -(out.logp.mean() + 1e-3 * out.entropy.mean())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device)
    del model, opt, out, loss, batch, responses
    gc.collect()
    torch.cuda.empty_cache()
    return int(peak)


def check_memory(device: str) -> list[Row]:
    """:func:`keye.rl.learner.plan.plan_memory`'s learner phase against a measured learner step, two settings."""
    import torch

    from keye.rl.learner.plan import GiB, plan_memory

    rows, length, response, grid, chunk = 2, 1024, 512, (1, 16, 16), 512
    config = _memory_config(layers=4)
    gpu_gb = torch.cuda.get_device_properties(device).total_memory / GiB
    out = []
    for ckpt in (False, True):
        measured = _learner_step_peak(config, device, rows=rows, length=length, response=response, grid=grid,
                                      checkpointing=ckpt, chunk=chunk)
        plan = plan_memory(config, world_size=1, strategy="ddp", dtype="bfloat16", micro_batch_tokens=rows * length,
                           micro_batch_sequences=rows, vision_patches=rows * grid[1] * grid[2],
                           response_tokens=rows * response, padded=False, gradient_checkpointing=ckpt,
                           logprob_chunk=chunk, rollout={"engine": "keye"}, gpu_memory_gb=gpu_gb, overhead_gb=0.0)
        planned = plan.learner_bytes
        ratio = planned / measured
        out.append(Row(f"memory plan vs max_memory_allocated ({'with' if ckpt else 'no'} checkpointing)",
                       _status(0.98 <= ratio <= 1.3),
                       f"planned {planned / GiB:.3f} GiB, measured {measured / GiB:.3f} GiB (x{ratio:.3f})",
                       "planned / measured in [0.98, 1.3]"))
    return out


def check_sft_memory(device: str) -> list[Row]:
    """:func:`keye.sft.plan.plan_sft_memory`'s peak against the measured peak of one real SFT step on the GPU."""
    import torch

    from keye.model.keye_vl import KeyeVL
    from keye.sft.plan import plan_sft_memory
    from keye.sft.step import optimizer_step
    from keye.train.dist import DistInfo, Wrapped
    from keye.train.plan import GiB

    config, length, grid, chunk = _memory_config(layers=4), 4096, (1, 32, 32), 512
    vision, answer_from = grid[1] * grid[2] // 4, length // 2
    out = []
    for ckpt in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        model = KeyeVL(config).to(device=device, dtype=torch.bfloat16).train()
        if ckpt:
            model.gradient_checkpointing_enable()
        for p in model.parameters():  # the recipe's bf16 training: float32 weights, bf16 autocast (keye/sft/model.py)
            p.data = p.data.float()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 30000, (1, length), generator=g)
        ids[0, 4:4 + vision] = config.image_token_id
        labels = ids.clone()
        labels[0, :answer_from] = -100
        mb = {"input_ids": ids, "attention_mask": torch.ones(1, length, dtype=torch.long), "labels": labels,
              "seq_lens": torch.tensor([length]), "packed": True, "image_grid_thw": torch.tensor([list(grid)]),
              "pixel_values": torch.randn(grid[1] * grid[2], 3, 14, 14, generator=g),
              "num_label_tokens": int((labels[0, 1:] != -100).sum()), "num_tokens": length, "num_samples": 1}
        for step in range(2):  # the second step's peak: AdamW's states exist from the first on, as in a run
            if step == 1:
                torch.cuda.reset_peak_memory_stats(device)
            # two micro-batches: the second runs with the first one's gradients alive, as the plan counts them
            optimizer_step([mb, mb], Wrapped(model, model, "none"), opt, DistInfo(device=torch.device(device)), amp=True,
                           tree_mode="off", pad_token_id=0, grad_clip=1.0, step=step, loss_chunk_tokens=chunk)
        measured = torch.cuda.max_memory_allocated(device)
        del model, opt, mb
        plan = plan_sft_memory(config, gpus=1, strategy="ddp", seq_len=length, vision_tokens=vision,
                               answer_tokens=length - answer_from - 1, gradient_checkpointing=ckpt,
                               loss_chunk_tokens=chunk, overhead_gb=0.0)
        ratio = plan.peak_bytes / measured
        out.append(Row(f"SFT memory plan vs max_memory_allocated ({'with' if ckpt else 'no'} checkpointing)",
                       _status(0.98 <= ratio <= 1.3),
                       f"planned {plan.peak_bytes / GiB:.3f} GiB, measured {measured / GiB:.3f} GiB (x{ratio:.3f})",
                       "planned / measured in [0.98, 1.3]"))
    gc.collect()
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------------------------------- vLLM
def check_vllm(device: str, model_path: str | None, max_diff: float, gpu_memory_utilization: float) -> Row:
    """Mean |vLLM log-prob - learner log-prob| on the tokens vLLM sampled."""
    import numpy as np
    import torch

    name = "vLLM vs learner log-probs (mean abs diff)"
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        return Row(name, "SKIP", note=f"vllm is not importable ({err})")
    if not model_path:
        return Row(name, "SKIP", note="needs --model (a Keye-VL checkpoint vLLM can load)")
    from keye import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.rl.rollout.engines import VLLMRollout
    from keye.rl.rollout.samples import RLPrompt, collate_samples
    from keye.rl.rollout.settings import SamplingSettings
    from keye.train.logprobs import token_logprobs

    temperature = 1.0
    processor = KeyeProcessor.from_pretrained(model_path)
    img = np.random.default_rng(0).integers(0, 255, (448, 448, 3), dtype=np.uint8)
    prompts = [RLPrompt("t1", [{"role": "user", "content": "What is 17 * 23? Answer with a number."}], mode="no_think"),
               RLPrompt("t2", [{"role": "user", "content": "Name three prime numbers."}], mode="no_think"),
               RLPrompt("i1", [{"role": "user", "content": [{"type": "image", "image": img},
                                                            {"type": "text", "text": "Describe the image."}]}])]
    engine = VLLMRollout(model_path, processor, SamplingSettings(max_new_tokens=64, temperature=temperature), seed=0, gpu_memory_utilization=gpu_memory_utilization, max_model_len=4096, dtype="bfloat16")
    samples = engine.generate(prompts, 2)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    batch = collate_samples(samples, processor.pad_token_id)
    model = KeyeVL.from_pretrained(model_path, torch_dtype="bfloat16", device=device).eval()
    with torch.no_grad():
        learner = token_logprobs(model, batch, batch["responses"], batch["response_attention"],
                                 temperature=temperature).logp.float().cpu()
    att = batch["response_attention"] & batch["has_rollout_logp"][:, None]
    diff = (learner - batch["rollout_logp"])[att]
    capped = float((torch.exp(learner - batch["rollout_logp"])[att] > 2.0).float().mean())
    mean, worst = float(diff.abs().mean()), float(diff.abs().max())
    return Row(name, _status(mean <= max_diff), f"{mean:.4f} (max {worst:.3f}, {diff.numel()} tokens)",
               f"<= {max_diff}", f"TIS weight > 2 on {capped:.2%} of tokens")


# --------------------------------------------------------------------------------------------------- main
def table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""
    w = max([len(r.check) for r in rows] + [5])
    lines = [f"{'check':<{w}}  {'status':<6}  {'measured':<58}  limit / note"]
    for r in rows:
        tail = "; ".join(x for x in (r.limit, r.note) if x)
        lines.append(f"{r.check:<{w}}  {r.status:<6}  {r.value:<58}  {tail}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module doc)."""
    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="checks to run (default: all)")
    ap.add_argument("--device", default="cuda:0", help="CUDA device (default cuda:0)")
    ap.add_argument("--model", default=None, help="Keye-VL checkpoint directory for the vLLM row")
    ap.add_argument("--max-logp-diff", type=float, default=0.05, help="vLLM row: bound on the mean abs difference")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM row: the engine's share of the GPU")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--cp-worker", default=None, help=argparse.SUPPRESS)  # one rank of the context check
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the selected checks; returns the exit status (0 pass, 1 fail, 2 no CUDA)."""
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check needs CUDA: torch.cuda.is_available() is False on this host (no GPU, or a CPU-only torch "
              "build). Run it by hand on a GPU host.", file=sys.stderr)
        return 2
    if args.cp_worker:
        return _cp_worker(args.cp_worker)
    # fp32 means fp32: no TF32 in matmuls or convolutions (the golden float32 row)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"device: {torch.cuda.get_device_name(args.device)}, torch {torch.__version__}", flush=True)
    rows: list[Row] = []
    plan: list[tuple[str, Any]] = []
    if "golden" in args.only:
        plan += [("golden parity float32", lambda: check_golden(args.device, "float32")),
                 ("golden parity bfloat16", lambda: check_golden(args.device, "bfloat16"))]
    if "flash" in args.only:
        plan.append(("flash-attn varlen vs sdpa vision", lambda: check_flash_vision(args.device)))
    if "context" in args.only:
        plan.append(("context parallel", lambda: check_context_parallel(args.device)))
    if "memory" in args.only:
        plan.append(("memory plan", lambda: check_memory(args.device)))
    if "sft_memory" in args.only:
        plan.append(("SFT memory plan", lambda: check_sft_memory(args.device)))
    if "vllm" in args.only:  # last: vLLM may keep GPU memory until the process ends
        plan.append(("vLLM vs learner log-probs",
                     lambda: check_vllm(args.device, args.model, args.max_logp_diff, args.gpu_memory_utilization)))
    for name, run in plan:
        t0 = time.perf_counter()
        try:
            got = run()
        except Exception as err:  # one broken check must not hide the others
            got = Row(name, "FAIL", note=f"{type(err).__name__}: {err}")
        for row in got if isinstance(got, list) else [got]:
            row.note = "; ".join(x for x in (row.note, f"{time.perf_counter() - t0:.1f} s") if x)
            rows.append(row)
        print(f"  {name}: {', '.join(r.status for r in (got if isinstance(got, list) else [got]))}", flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    failed = [r for r in rows if r.status == "FAIL"]
    print(f"{len(rows) - len(failed)} of {len(rows)} rows passed or skipped" + (f", {len(failed)} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
