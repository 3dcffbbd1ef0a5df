"""Peak memory of token log-probs + entropy + backward: full-vocabulary logits vs chunks recomputed in backward.

4,096 predicted tokens, hidden size 1,024, Qwen3's vocabulary of 151,936, float32 on CPU. Both sides compute
the same thing - ``log_softmax(lm_head(h))`` at the target ids and the entropy of every distribution - and
backpropagate a random linear function of both into the hidden states and the head's weight:

- full: the logits of all tokens at once (what the tree path did before; [4096, 151936] float32 is 2.3 GiB
  and autograd keeps several such tensors for the backward);
- chunked: :func:`keye.train.logprobs.chunked_token_logprobs` with its default chunk, each chunk recomputed in
  the backward.

Memory is the peak RSS during the block minus the RSS at its start (sampled by a thread; the weight
gradient is included on both sides), each side in a fresh process per repeat; the values and gradients of
the two sides are compared (rtol = atol = 1e-5). The last line is the ratio of the medians. Last line:
``logprob peak memory full vs chunked: X.XXx less (values equal: yes)``
Usage: python benchmarks/logprob_memory.py [--repeats 3] [--tokens 4096] [--hidden 1024] [--vocab 151936] [--quick]
       (``--quick``: one fresh process at 1,024 tokens, hidden 64, vocabulary 8,000: seconds)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import torch.nn.functional as F
from _memory import PeakRSS

from keye.train.logprobs import DEFAULT_CHUNK_TOKENS, chunked_token_logprobs


def _inputs(tokens: int, hidden: int, vocab: int):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 0.05)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    g_lp, g_ent = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    return head, h, labels, g_lp, g_ent


def _full(head, h, labels):
    logsm = F.log_softmax(head(h).float(), dim=-1)
    return logsm.gather(-1, labels[:, None]).squeeze(-1), -(logsm.exp() * logsm).sum(-1)


def _chunked(head, h, labels):
    rows = torch.arange(h.shape[0])
    return chunked_token_logprobs(h, rows, labels, head, with_entropy=True, chunk_size=DEFAULT_CHUNK_TOKENS)


def _measure(fn, head, h, labels, g_lp, g_ent):
    head.zero_grad(set_to_none=True)
    h.grad = None
    t0 = time.perf_counter()
    with PeakRSS() as mem:
        lp, ent = fn(head, h, labels)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        del lp, ent
    # the results are kept outside the measured block for the comparison
    return mem.extra_mib, time.perf_counter() - t0


def _child(sizes, queue, threads: int = 2):
    torch.set_num_threads(threads)
    head, h, labels, g_lp, g_ent = _inputs(*sizes)
    with torch.no_grad():
        ref_lp, ref_ent = _chunked(head, h, labels)
    chunked_mib, chunked_s = _measure(_chunked, head, h, labels, g_lp, g_ent)
    c_dh, c_dw = h.grad.clone(), head.weight.grad.clone()
    full_mib, full_s = _measure(_full, head, h, labels, g_lp, g_ent)
    with torch.no_grad():
        f_lp, f_ent = _full(head, h, labels)
    equal = True
    for a, b in ((ref_lp, f_lp), (ref_ent, f_ent), (c_dh, h.grad), (c_dw, head.weight.grad)):
        equal &= bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    queue.put((full_mib, chunked_mib, full_s, chunked_s, equal))


def run_once(sizes, threads: int = 2):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(sizes, q, threads))
    p.start()
    out = q.get()
    p.join()
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last line is the ratio."""
    from _quick import parse_args, torch_threads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    args = parse_args(ap, argv, {"repeats": 1, "tokens": 1024, "hidden": 64, "vocab": 8000})
    sizes = (args.tokens, args.hidden, args.vocab)
    runs = []
    for i in range(args.repeats):
        full_mib, chunked_mib, full_s, chunked_s, equal = run_once(sizes, torch_threads(args))
        runs.append((full_mib, chunked_mib, equal))
        print(f"run {i + 1}: full {full_mib:.0f} MiB ({full_s:.1f} s), chunked {chunked_mib:.0f} MiB "
              f"({chunked_s:.1f} s, chunk {DEFAULT_CHUNK_TOKENS}), values and gradients equal: {equal}", flush=True)
    full = statistics.median(r[0] for r in runs)
    chunked = statistics.median(r[1] for r in runs)
    equal = all(r[2] for r in runs)
    print(f"{args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}: median peak extra memory "
          f"full {full:.0f} MiB, chunked {chunked:.0f} MiB")
    print(f"logprob peak memory full vs chunked: {full / max(chunked, 1e-3):.2f}x less "
          f"(values equal: {'yes' if equal else 'no'})")


if __name__ == "__main__":
    main()
