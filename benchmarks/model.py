"""Model speed and memory claims, measured on CPU with a small random Keye-VL.

  (a) packed vision tower vs a per-image loop on 8 mixed-size images        -> speedup
  (b) prefill tokens/s                                                      -> (absolute)
  (c) decode tokens/s with the KV cache vs recomputing the full prefix       -> speedup
  (d) peak memory of the packed tower on 8 images vs one dense
      block-diagonal N x N mask over the whole pack                         -> memory ratio
  (e) generate, transformers path (GenerationMixin.generate) vs the previous
      Keye loop (generate_steps), greedy, batch 1 and 4                     -> time ratio
  (f) the text decoder vs transformers' Qwen3ForCausalLM on identical weights:
      prefill, and greedy generation with the cache at batch 1 and 4       -> speed ratio (within 10 %?)

Each part prints its ratio as its last line; the script's last line is (f)'s overall ratio (median over
its rows of Qwen3 time / Keye time: above 0.90 means Keye is within 10 % of Qwen3's speed).
Timings of two contenders are interleaved run by run, so load changes on a shared machine hit both.
Last line (all parts): ``(f) decoder speed Keye / Qwen3ForCausalLM, median over the rows: X.XXx (worst row Y.YYx;
within 10 %: yes|no)``
Usage: python benchmarks/model.py [--repeats 5] [--parts abcdef] [--prefill 1024] [--new-tokens 32] [--quick]
       (``--quick``: every part once, 256-token prefill, 8 new tokens: seconds)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import torch.nn.functional as F
from _memory import PeakRSS

from keye.config import TextConfig, VisionConfig, tiny_config
from keye.model import vision as vision_mod
from keye.testing.model import init_unit_scale, qwen3_twin

GRIDS = [(1, 24, 32), (1, 16, 16), (1, 8, 40), (1, 32, 20), (1, 12, 12), (1, 20, 28), (1, 4, 6), (1, 28, 24)]


def bench_config():
    return tiny_config(
        text=TextConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=32, mrope_section=(4, 6, 6)),
        vision=VisionConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                            image_size=112, patch_size=14),
    )


def build():
    from keye.model.keye_vl import KeyeVL

    torch.manual_seed(0)
    return init_unit_scale(KeyeVL(bench_config())).eval()


def median_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_median(fn_a, fn_b, repeats):
    """Median seconds of two callables timed alternately (one warm-up each)."""
    fn_a()
    fn_b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((fn_a, ta), (fn_b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def pixels(grids):
    return torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14)


@torch.no_grad()
def part_a(model, repeats):
    pix = pixels(GRIDS)
    chunks = pix.split([t * h * w for t, h, w in GRIDS])
    packed = median_time(lambda: model.visual(pix, GRIDS), repeats)
    loop = median_time(lambda: [model.visual(c, [g]) for c, g in zip(chunks, GRIDS)], repeats)
    print(f"(a) vision tower, 8 mixed images ({pix.shape[0]} patches): packed {packed * 1e3:.1f} ms, "
          f"per-image loop {loop * 1e3:.1f} ms (median of {repeats})")
    print(f"(a) speedup packed vs per-image loop: {loop / packed:.2f}x")


@torch.no_grad()
def part_b(model, repeats, prefill: int = 1024):
    ids = torch.randint(0, 4000, (1, prefill))
    t = median_time(lambda: model(input_ids=ids, logits_to_keep=1), repeats)
    print(f"(b) prefill of {prefill} tokens: {t * 1e3:.1f} ms")
    print(f"(b) prefill throughput: {prefill / t:.0f} tokens/s")


@torch.no_grad()
def part_c(model, repeats, n_new: int = 32):
    ids = torch.randint(0, 4000, (1, 256))

    def cached():
        model.generate(ids, max_new_tokens=n_new, eos_token_id=[])

    def uncached():
        seq = ids
        for _ in range(n_new):
            nxt = model(input_ids=seq, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)

    tc = median_time(cached, repeats)
    tu = median_time(uncached, repeats)
    print(f"(c) decode {n_new} tokens after a 256-token prompt: with cache {n_new / tc:.0f} tok/s, "
          f"without {n_new / tu:.0f} tok/s")
    print(f"(c) speedup KV cache vs full recompute: {tu / tc:.2f}x")


def _dense_block_attention(q, k, v, cu_seqlens, *, scale, causal, backend="sdpa"):
    """Baseline: one dense N x N block-diagonal mask over the whole pack."""
    n = q.shape[0]
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    mask = seg[:, None] == seg[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).reshape(n, *q.shape[1:])


def _peak_child(dense, queue, threads: int = 2):
    torch.set_num_threads(threads)
    model = build()
    pix = pixels(GRIDS)
    if dense:
        vision_mod.varlen_attention = _dense_block_attention
    with torch.no_grad(), PeakRSS() as mem:
        model.visual(pix, GRIDS)
    queue.put(mem.extra_mib)


def peak_mib(dense, threads: int = 2):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_peak_child, args=(dense, q, threads))
    p.start()
    p.join()
    return q.get()


def part_d(repeats, threads: int = 2):
    packed = statistics.median(peak_mib(False, threads) for _ in range(max(1, repeats // 2)))
    dense = statistics.median(peak_mib(True, threads) for _ in range(max(1, repeats // 2)))
    print(f"(d) peak extra memory of the tower on 8 images: packed varlen {packed:.0f} MiB, "
          f"dense block-diagonal mask {dense:.0f} MiB")
    print(f"(d) memory ratio dense mask / packed varlen: {dense / max(packed, 1e-3):.2f}x")


@torch.no_grad()
def part_e(model, repeats, n_new: int = 32):
    ratios = []
    for bsz in (1, 4):
        ids = torch.randint(0, 4000, (bsz, 128))
        hf, own = paired_median(
            lambda ids=ids: model.generate(ids, max_new_tokens=n_new, eos_token_id=[], do_sample=False),
            lambda ids=ids: model._generate_keye(ids, max_new_tokens=n_new, eos_token_id=[], do_sample=False),
            repeats,
        )
        ratios.append(own / hf)
        print(f"(e) generate, transformers path vs previous loop, batch {bsz}, {n_new} new tokens after 128: "
              f"transformers {bsz * n_new / hf:.0f} tok/s, previous loop {bsz * n_new / own:.0f} tok/s "
              f"(speed ratio {own / hf:.2f})")
    print(f"(e) generate speed, transformers path / previous loop (median over batch 1 and 4): "
          f"{statistics.median(ratios):.2f}x")


@torch.no_grad()
def part_f(model, repeats, prefill: int = 1024, n_new: int = 32):
    hf = qwen3_twin(model)
    rows = []
    ids = torch.randint(0, 4000, (1, prefill))
    ours, theirs = paired_median(lambda: model(input_ids=ids, logits_to_keep=1),
                                 lambda: hf(input_ids=ids, logits_to_keep=1), repeats)
    rows.append((f"prefill {prefill} tokens, batch 1", ours, theirs))
    kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    for bsz in (1, 4):
        ids = torch.randint(0, 4000, (bsz, 128))
        ours, theirs = paired_median(lambda ids=ids: model.generate(ids, **kw),
                                     lambda ids=ids: hf.generate(ids, **kw), repeats)
        rows.append((f"greedy generate {n_new} after 128 (cache), batch {bsz}", ours, theirs))
    for name, ours, theirs in rows:
        print(f"(f) {name}: Keye {ours * 1e3:.1f} ms, Qwen3ForCausalLM {theirs * 1e3:.1f} ms "
              f"(speed ratio {theirs / ours:.2f})")
    ratio = statistics.median(theirs / ours for _, ours, theirs in rows)
    worst = min(theirs / ours for _, ours, theirs in rows)
    print(f"(f) decoder speed Keye / Qwen3ForCausalLM, median over the rows: {ratio:.2f}x (worst row {worst:.2f}x; "
          f"within 10 %: {'yes' if ratio >= 0.9 else 'no'})")


def main(argv: list[str] | None = None) -> None:
    """Run the parts named by ``--parts`` with the command line ``argv`` (``None``: ``sys.argv[1:]``); each part's
    last line is its ratio, so the script's last line is the last part's."""
    from _quick import parse_args, torch_threads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", default="abcdef", help="which parts to run (letters a-f)")
    ap.add_argument("--prefill", type=int, default=1024, help="(b), (f) prefill tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="(c), (e), (f) generated tokens")
    args = parse_args(ap, argv, {"repeats": 1, "prefill": 256, "new_tokens": 8})
    torch.set_num_threads(torch_threads(args))
    model = build()
    parts = {"a": lambda: part_a(model, args.repeats), "b": lambda: part_b(model, args.repeats, args.prefill),
             "c": lambda: part_c(model, args.repeats, args.new_tokens), "d": lambda: part_d(args.repeats, torch_threads(args)),
             "e": lambda: part_e(model, args.repeats, args.new_tokens),
             "f": lambda: part_f(model, args.repeats, args.prefill, args.new_tokens)}
    for letter in args.parts:
        parts[letter]()


if __name__ == "__main__":
    main()
