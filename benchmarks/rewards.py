"""Rewards per second on 10,000 synthetic RL responses, single process.

The responses imitate GRPO groups (16 rollouts per prompt, so final answers repeat within a group): think,
no-think and auto-think modes; multiple-choice, numeric, math (LaTeX, equivalent surface forms) and JSON tasks;
about 12% malformed (unclosed/duplicated tags, text after the answer, missing answer, degenerate loops).

Measured in the same run:
- format-only spec (the baseline: tag parsing only);
- the full spec (format, accuracy, json, repetition, overlong) with the math-verify verdict cache;
- the math responses alone with the cache disabled vs enabled (every non-trivial pair goes to the worker),
  and the median latency of one uncached math-verify check in-process vs through the worker process.

Throughput is reported as the median over chunks of 500 responses. The last line is the full spec's
throughput relative to the format-only baseline. Last line:
``full spec vs format-only baseline throughput (median rewards/s): X.XXx (N vs M)``

Usage: .venv/bin/python benchmarks/rewards.py [--n 10000] [--full] [--quick]   (``--quick``: 400 responses)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from keye.rewards import RewardSpec, score  # noqa: E402
from keye.rewards.mathverify import get_verifier  # noqa: E402

WORDS = ("the", "area", "of", "triangle", "is", "so", "we", "compute", "angle", "side", "value", "then", "sum",
         "image", "shows", "bar", "chart", "count", "objects", "left", "right", "therefore", "each", "equal")
MATH_GOLDS = [
    ("\\frac{1}{2}", ["\\frac{1}{2}", "0.5", "\\dfrac{1}{2}", "1/2"]),
    ("2\\sqrt{2}", ["2\\sqrt{2}", "\\sqrt{8}", "2 \\sqrt{2}"]),
    ("x^2+2x+1", ["x^2+2x+1", "(x+1)^2", "x^{2} + 2x + 1"]),
    ("\\frac{\\pi}{4}", ["\\frac{\\pi}{4}", "\\pi/4", "0.25\\pi"]),
    ("3", ["3", "x = 3", "3.0"]),
    ("\\frac{3}{4}", ["\\frac34", "0.75", "\\frac{3}{4}"]),
]
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
    if rng.random() < 0.5:
        words.append(f"{rng.randint(1, 99)} + {rng.randint(1, 99)} = {rng.randint(2, 198)}")
    return " ".join(words).capitalize() + "."


def reasoning(rng: random.Random) -> str:
    lines = []
    for k in range(1, rng.randint(2, 8) + 1):
        body = " ".join(sentence(rng) for _ in range(rng.randint(1, 4)))
        lines.append(f"Step {k}: {body}" if rng.random() < 0.6 else body)
    return "\n".join(lines)


def wrap(rng: random.Random, mode: str, answer: str) -> str:
    """Lay out one response in the requested mode (with optional <answer> wrapper)."""
    final = f"<answer>{answer}</answer>" if rng.random() < 0.4 else answer
    if mode == "think":
        return f"<think>\n{reasoning(rng)}\n</think>\n\n{final}"
    if mode == "no_think":
        return final if rng.random() < 0.7 else f"{sentence(rng)}\n{final}"
    if rng.random() < 0.4:
        return f"<analysis>This needs careful reasoning, so /think mode.</analysis><think>{reasoning(rng)}</think>\n{final}"
    return f"<analysis>This question is straightforward, so /no_think mode.</analysis>\n{final}"


def malform(rng: random.Random, text: str) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return text.replace("</think>", "", 1) if "</think>" in text else "<think>" + text
    if kind == 1:
        return text + "\n<think>second thoughts</think>"
    if kind == 2:
        return text + "</answer> and more text"
    if kind == 3:
        return text.rsplit("\n", 1)[0]
    return text + (" and so on" * rng.randint(50, 400))


def make_group(rng: random.Random, size: int = 16) -> list[dict]:
    task = rng.choices(["mc", "numeric", "math", "json"], weights=[0.3, 0.3, 0.25, 0.15])[0]
    mode = rng.choices(["think", "no_think", "auto"], weights=[0.5, 0.25, 0.25])[0]
    samples = []
    if task == "mc":
        choices = [" ".join(rng.choice(WORDS) for _ in range(3)) for _ in range(4)]
        gold = rng.choice("ABCD")
    elif task == "numeric":
        gold = str(rng.randint(-500, 5000))
    elif task == "math":
        gold, forms = rng.choice(MATH_GOLDS)
    else:
        gold = {"answer": rng.randint(0, 100)}
    for _ in range(size):
        right = rng.random() < 0.5
        if task == "mc":
            letter = gold if right else rng.choice("ABCD")
            answer = rng.choice([letter, f"({letter})", f"**{letter}**", f"The answer is {letter}.",
                                 f"{letter}. {choices['ABCD'.index(letter)]}"])
            extra = {"choices": choices, "instructions": {}}
        elif task == "numeric":
            value = int(gold) if right else int(gold) + rng.randint(1, 9)
            answer = rng.choice([f"\\boxed{{{value}}}", f"The answer is {value}.", f"{value:,}", str(value)])
            extra = {"instructions": {}}
        elif task == "math":
            form = rng.choice(forms) if right else f"\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(2, 9)}}}"
            answer = f"\\boxed{{{form}}}" if rng.random() < 0.7 else form
            extra = {"instructions": {}}
        else:
            value = gold["answer"] if right else rng.randint(0, 100)
            answer = f'{{"answer": {value}}}' if rng.random() < 0.8 else f'```json\n{{"answer": {value}}}\n```'
            extra = {"instructions": {"json": True, "json_schema": JSON_SCHEMA}}
        text = wrap(rng, mode, answer)
        if rng.random() < 0.12:
            text = malform(rng, text)
        samples.append({"response": text, "reference": gold, "task": task, "mode": mode, **extra})
    return samples


def make_samples(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        out.extend(make_group(rng))
    return out[:n]


def run(samples: list[dict], spec: RewardSpec, chunk: int = 500) -> tuple[float, float, list[float]]:
    """(median chunk throughput, overall throughput, totals) of scoring ``samples`` with ``spec``."""
    rates, totals = [], []
    start = time.perf_counter()
    for i in range(0, len(samples), chunk):
        t0 = time.perf_counter()
        for s in samples[i : i + chunk]:
            s = dict(s)
            totals.append(score(s.pop("response"), s.pop("reference"), s.pop("task"), s.pop("mode"), spec, **s).total)
        rates.append(len(samples[i : i + chunk]) / (time.perf_counter() - t0))
    overall = len(samples) / (time.perf_counter() - start)
    return statistics.median(rates), overall, totals


def _median_latency_ms(pairs: list[tuple[str, str]], backend: str) -> tuple[float, int]:
    from keye.rewards.accuracy import check_math
    from keye.rewards.mathverify import MathVerifier
    from keye.rewards.text import final_answer

    verifier = MathVerifier(timeout_s=5.0, backend=backend, cache_size=0)
    verifier.equivalent("1", "1")  # start the worker / warm SymPy outside the timing
    times = []
    for gold, response in pairs:
        answer = final_answer(response)
        calls = verifier.stats["calls"]
        t0 = time.perf_counter()
        check_math(answer, gold, verifier)
        if verifier.stats["calls"] > calls:  # only pairs the string / number fast paths could not decide
            times.append((time.perf_counter() - t0) * 1e3)
    verifier.close()
    return statistics.median(times), len(times)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last line is the ratio."""
    from _quick import parse_args

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="number of synthetic responses")
    parser.add_argument("--full", action="store_true", help="also run the uncached math comparison on all math items")
    args = parse_args(parser, argv, {"n": 400})

    samples = make_samples(args.n)
    math_samples = [s for s in samples if s["task"] == "math"]
    if not args.full:
        math_samples = math_samples[:600]
    print(f"{len(samples)} responses; tasks: " + ", ".join(
        f"{t}={sum(s['task'] == t for s in samples)}" for t in ("mc", "numeric", "math", "json")))

    full = RewardSpec(format=1.0, accuracy=1.0, json=1.0, repetition=0.5, overlong=1.0)
    fmt_only = RewardSpec(format=1.0, accuracy=0.0)
    # Start the math worker before timing (a one-off ~0.4 s process start, not a per-reward cost).
    get_verifier(full.math_timeout_s, full.math_backend, full.math_cache_size).equivalent("1", "1")

    fmt_med, fmt_all, _ = run(samples, fmt_only)
    print(f"format-only:           median {fmt_med:9.0f} rewards/s  (overall {fmt_all:9.0f}/s)")
    full_med, full_all, totals = run(samples, full)
    stats = get_verifier(full.math_timeout_s, full.math_backend, full.math_cache_size).stats
    print(f"full spec (cached):    median {full_med:9.0f} rewards/s  (overall {full_all:9.0f}/s), "
          f"mean total {statistics.fmean(totals):.3f}; math-verify calls {stats['calls']}, "
          f"cache hits {stats['cache_hits']}, timeouts {stats['timeouts']}")

    math_spec = RewardSpec(format=0.0, accuracy=1.0)
    nocache_spec = RewardSpec(format=0.0, accuracy=1.0, math_cache_size=0)
    get_verifier(nocache_spec.math_timeout_s, nocache_spec.math_backend, 0).equivalent("1", "1")
    get_verifier(math_spec.math_timeout_s, math_spec.math_backend, math_spec.math_cache_size).clear_cache()
    _, cached_all, _ = run(math_samples, math_spec, chunk=100)
    _, uncached_all, _ = run(math_samples, nocache_spec, chunk=100)
    print(f"math only ({len(math_samples)} items): cached {cached_all:.0f}/s vs uncached {uncached_all:.0f}/s "
          f"-> cache speedup {cached_all / uncached_all:.1f}x")
    # Cost of the killable worker: the same uncached math-verify pairs in this process (SIGALRM timeout,
    # main thread only) versus through the worker's pipes.
    pairs = [(s["reference"], s["response"]) for s in math_samples[:300]]
    inline_ms, _ = _median_latency_ms(pairs, "inline")
    process_ms, n_verified = _median_latency_ms(pairs, "process")
    print(f"math-verify per uncached pair (median of {n_verified}): inline {inline_ms:.2f} ms, "
          f"worker process {process_ms:.2f} ms -> IPC overhead {process_ms - inline_ms:+.2f} ms")
    print(f"full spec vs format-only baseline throughput (median rewards/s): {full_med / fmt_med:.2f}x "
          f"({full_med:.0f} vs {fmt_med:.0f})")


if __name__ == "__main__":
    main()
