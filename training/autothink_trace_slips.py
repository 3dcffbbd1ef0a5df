"""Why sampled thinking loses what greedy thinking gains: where think replies go wrong, greedy vs sampled.
from keye.rl.rollout.settings import SamplingSettings

For one checkpoint and a held-out manifest written by ``keye data synth --modes`` (each row carries its exact
reference trace in ``modes.think``), samples ``--samples`` replies per question in think and in no_think mode
with the RL rollout engine (:class:`keye.rl.LocalRollout`, ``--temperature``, default 1.0 as in
``tiny_autothink_rl.yaml``), scores them with the RL reward's accuracy check, decodes the same prompts greedily,
and splits every think reply into: correct; wrong with the exact reference trace (the step from trace to answer
slipped); wrong with a different trace (a reading slipped).

Prints one table (accuracy per mode and decoding, think - no_think edge, trace-exact rate, wrong think replies
by cause) and writes it with the per-type edges to ``--out`` as JSON.

Usage:
  python training/autothink_trace_slips.py runs/autothink_mixed/rl/final \\
      --data runs/autothink_mixed/data/test/test.jsonl --out runs/autothink_mixed/trace_slips_rl.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate per-reply rows (``decoding``, ``mode``, ``type``, ``passed``, ``trace_exact``) into
    accuracy per decoding and mode, the think - no_think edge (overall and per type), the trace-exact rate of
    think replies and the causes of wrong think replies."""
    out: dict[str, Any] = {}
    for dec in sorted({r["decoding"] for r in rows}):
        mine = [r for r in rows if r["decoding"] == dec]
        acc = {m: _mean([r["passed"] for r in mine if r["mode"] == m]) for m in ("think", "no_think")}
        think = [r for r in mine if r["mode"] == "think"]
        wrong = [r for r in think if not r["passed"]]
        per_type: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
        for r in mine:
            per_type[r["type"]][r["mode"]].append(r["passed"])
        out[dec] = {
            "replies_per_mode": len(think),
            "accuracy": acc,
            "edge": acc["think"] - acc["no_think"],
            "think_trace_exact": _mean([r["trace_exact"] for r in think]),
            "wrong_think": len(wrong),
            "wrong_think_with_exact_trace": sum(r["trace_exact"] for r in wrong),
            "edge_by_type": {t: _mean(m["think"]) - _mean(m["no_think"]) for t, m in sorted(per_type.items())},
        }
    return out


def _mean(xs: list[Any]) -> float:
    return sum(map(float, xs)) / len(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--data", required=True, help="held-out manifest with modes.think reference traces")
    ap.add_argument("--samples", type=int, default=4, help="sampled replies per question and mode")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file for the summary")
    args = ap.parse_args(argv)

    from keye.model.keye_vl import KeyeVL
    from keye.processing.chat import parse_response
    from keye.processing.processor import KeyeProcessor
    from keye.rewards import RewardSpec
    from keye.rl import LocalRollout, SamplingSettings, load_rl_prompts
    from keye.rl.algorithms.autothink import expand
    from keye.rl.rollout.scoring import RewardScorer

    items = {}
    for n, line in enumerate(Path(args.data).read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SystemExit(f"{args.data}:{n}: not a JSON row ({err})") from None
            think = (row.get("modes") or {}).get("think")
            if think is None:
                raise SystemExit(f"{args.data}:{n}: no modes.think reference trace (write it with keye data synth --modes)")
            items[row["id"]] = (row["question_type"], parse_response(think).think or "")
    model = KeyeVL.from_pretrained(args.checkpoint, torch_dtype="float32").eval()
    proc = KeyeProcessor.from_pretrained(args.checkpoint)
    prompts = load_rl_prompts(args.data)
    roles = expand(prompts)
    scorer = RewardScorer(RewardSpec.from_dict({"rewards": ["accuracy"]}))  # tiny_autothink_rl.yaml's reward

    rows = []
    decodings = [("greedy", 1e-4, 1), (f"T={args.temperature:g}", args.temperature, args.samples)]
    for name, temperature, count in decodings:
        # at temperature 1e-4 a token 1e-3 below the arg-max logit is drawn with probability ~exp(-10)
        engine = LocalRollout(model, proc, SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=temperature), seed=args.seed)
        for mode, role in (("think", "think"), ("no_think", "direct")):
            samples = engine.generate(roles[role], count)
            scores = scorer(samples)
            for s, ok in zip(samples, scores.passed):
                qtype, ref_think = items[s.prompt.id]
                got = parse_response(s.text).think
                rows.append({"decoding": name, "mode": mode, "type": qtype, "passed": bool(ok),
                             "trace_exact": got is not None and got.strip() == ref_think.strip()})
            print(f"{name} {mode}: {len(samples)} replies", file=sys.stderr, flush=True)
    summary = {"checkpoint": str(args.checkpoint), "data": str(args.data), "questions": len(prompts),
               **summarise(rows)}
    print("| decoding | think % | no_think % | edge (pp) | think traces exact % | wrong think replies | of them with the exact trace |")
    print("|---|---|---|---|---|---|---|")
    for dec, s in summary.items():
        if isinstance(s, dict):
            print(f"| {dec} | {100 * s['accuracy']['think']:.1f} | {100 * s['accuracy']['no_think']:.1f} | "
                  f"{100 * s['edge']:+.1f} | {100 * s['think_trace_exact']:.1f} | {s['wrong_think']} | "
                  f"{s['wrong_think_with_exact_trace']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
