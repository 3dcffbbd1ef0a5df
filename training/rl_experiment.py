"""GRPO baseline vs RLEP on keye-tiny and the synthetic video-QA set: one command, one report.

Both runs start from the same SFT checkpoint with the same seed, prompts and step budget
(``training/configs/tiny_synth_grpo.yaml`` and ``tiny_synth_rlep.yaml`` differ only in ``replay``).
Steps, each skipped when its output already exists so an interrupted experiment resumes:

  1. the RL question set: the first ``--questions`` rows of ``data/synth/train.jsonl`` whose answer kind
     is ``--kind`` (default all: keye-tiny answers multiple-choice questions with the option's text, scored
     by the MMMU rule, so every type's reward carries signal; ``numeric`` was the default while keye-tiny
     answered them with one constant letter)
  2. phase A: ``keye rlep collect`` samples ``--n`` answers per question from the SFT start and keeps
     the verified ones (the replay pool)
  3. the GRPO baseline run, then the RLEP run (each resumes from its own checkpoints)
  4. a paired final comparison: greedy and avg@``--final-samples`` answers of the start and both final
     checkpoints on every held-out question, each run against the start and RLEP against GRPO
     (``final_comparison.json``, with the per-question table of every checkpoint)
  5. ``report.json`` and ``report.md`` in ``--out``: both held-out accuracy curves (greedy, and avg@k
     sampled when the configs set ``eval.samples``), the SFT start, the baseline's best and the first step
     at which RLEP reaches it

Usage:
  python training/rl_experiment.py                      # the committed experiment, from keye-tiny
  python training/rl_experiment.py --steps 2 --questions 8 --n 4 --final-samples 0 --out /tmp/rlx \\
      eval.limit=4 eval.samples=2   # test-sized: the same configs and code path, seconds not minutes
Extra ``key=value`` arguments are dot-list overrides applied to both runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def compare(grpo: list[dict[str, Any]], rlep: list[dict[str, Any]], key: str = "accuracy") -> dict[str, Any]:
    """Summarise two held-out curves (lists of ``{"step", "accuracy", "n"}``, step 0 = the start), on
    ``key`` (``accuracy``: greedy; ``sampled_accuracy``: avg@k).

    Returns the start accuracy, each run's best over its RL steps (step > 0 when the curve has any; value
    and first step reaching it), and ``rlep_reaches_baseline_best_at``: the first RLEP step > 0 whose
    accuracy is >= the baseline's best (``None`` when it never does). Step 0 is the shared start, so it
    cannot count as either run reaching anything.
    """
    if not grpo or not rlep:
        raise ValueError("both runs need a non-empty eval curve (set eval.manifest and eval.every)")

    def trained(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [c for c in curve if c["step"] > 0] or curve

    def best(curve: list[dict[str, Any]]) -> tuple[float, int]:
        curve = trained(curve)
        top = max(c[key] for c in curve)
        return top, min(c["step"] for c in curve if c[key] == top)

    g_best, g_step = best(grpo)
    r_best, r_step = best(rlep)
    reach = next((c["step"] for c in sorted(trained(rlep), key=lambda c: c["step"]) if c[key] >= g_best), None)
    return {
        "metric": key,
        "start_accuracy": grpo[0][key] if grpo[0]["step"] == 0 else None,
        "grpo_best": g_best, "grpo_best_step": g_step,
        "rlep_best": r_best, "rlep_best_step": r_step,
        "rlep_reaches_baseline_best_at": reach,
        "grpo_final": grpo[-1][key], "rlep_final": rlep[-1][key],
        "n_eval": int(grpo[0]["n"]),
    }


def markdown(summary: dict[str, Any], grpo: list[dict[str, Any]], rlep: list[dict[str, Any]],
             sampled: dict[str, Any] | None = None) -> str:
    """The report table (docs/experiments/rl-grpo-vs-rlep.md): held-out accuracy (%) per evaluated step for
    both runs (greedy, and avg@k sampled when ``sampled``, the :func:`compare` summary on ``sampled_accuracy``,
    is given), then the summaries."""
    keys = ["accuracy"] + (["sampled_accuracy"] if sampled else [])
    by_step: dict[int, list[Any]] = {}
    for col, curve in enumerate((grpo, rlep)):
        for c in curve:
            row = by_step.setdefault(c["step"], [None] * (2 * len(keys)))
            for j, key in enumerate(keys):
                row[2 * j + col] = c.get(key)
    fmt = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
    head = ["GRPO baseline %", "RLEP %"]
    if sampled:
        k = int(next(c["samples"] for c in grpo if "samples" in c))
        head = ["GRPO greedy %", "RLEP greedy %", f"GRPO avg@{k} %", f"RLEP avg@{k} %"]
    lines = ["| RL step | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join(fmt(v) for v in row) + " |" for s, row in sorted(by_step.items())]
    lines.append("")
    for name, summ in (("greedy accuracy" if sampled else "accuracy", summary), ("avg@k sampled accuracy", sampled)):
        if not summ:
            continue
        reach = summ["rlep_reaches_baseline_best_at"]
        lines.append(
            f"Held-out {name} on {summ['n_eval']} questions. SFT start {fmt(summ['start_accuracy'])} %; "
            f"best after training: GRPO {fmt(summ['grpo_best'])} % (step {summ['grpo_best_step']}), RLEP "
            f"{fmt(summ['rlep_best'])} % (step {summ['rlep_best_step']}); RLEP reaches the baseline's best "
            + (f"at step {reach}." if reach is not None else "within the budget: no.")
        )
    return "\n".join(lines) + "\n"


def paired(start: dict[str, list[int]], run: dict[str, list[int]], kinds: dict[str, str]) -> dict[str, Any]:
    """Paired change from the SFT start to a trained run, per question, overall and per answer kind.

    ``start`` / ``run`` map question id to ``[greedy passed, sampled passed, sampled n]`` (the
    ``per_prompt`` table of :func:`keye.rl.loop.evaluate.greedy_accuracy`, same questions and sampling seed).
    For each group and each metric (``greedy``, ``sampled``) returns the start and run means and the mean
    per-question difference with its standard error, as :func:`keye.eval.modes.paired_diff` computes them
    (sample std / sqrt(n); ``se`` None for a group of one question).
    """
    from keye.eval.modes import paired_diff

    def greedy(table: dict[str, list[int]], ids: list[str]) -> list[dict[str, Any]]:
        return [{"id": i, "correct": bool(table[i][0])} for i in ids]

    def sampled(table: dict[str, list[int]], ids: list[str]) -> list[dict[str, Any]]:
        # one record per sample (``<id>#s<k>``): paired_diff averages them into the question's pass rate
        return [{"id": f"{i}#s{k}", "correct": k < table[i][1]} for i in ids for k in range(table[i][2])]

    out: dict[str, Any] = {}
    for group in ("all", *sorted(set(kinds.values()))):
        ids = [i for i in start if group == "all" or kinds.get(i) == group]
        if not ids:
            continue
        row: dict[str, Any] = {"n": len(ids)}
        for metric, records in (("greedy", greedy), ("sampled", sampled)):
            d = paired_diff(records(run, ids), records(start, ids))
            row[metric] = {"start": d["acc_b"], "run": d["acc_a"], "diff": d["diff"], "se": d["se"]}
        out[group] = row
    return out


def final_comparison(policy: str, runs: dict[str, Path], test: Path, samples: int, out: Path) -> dict[str, Any]:
    """Greedy and avg@``samples`` answers of the SFT start and each run's final checkpoint on every
    question of ``test`` (one sampling seed for all), and the paired changes (:func:`paired`)."""
    import torch

    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor
    from keye.rewards import RewardSpec
    from keye.rl import RewardScorer, load_rl_prompts
    from keye.rl.loop.evaluate import greedy_accuracy
    from keye.tiny import resolve_model_path

    torch.set_flush_denormal(True)
    prompts = load_rl_prompts(test)
    rows = [json.loads(r) for r in test.read_text().splitlines() if r.strip()]
    kinds = {r["id"]: r.get("answer_kind", "?") for r in rows}
    scorer = RewardScorer(RewardSpec.from_dict({"rewards": ["accuracy"]}))
    tables = {}
    for name, path in {"start": policy, **{k: str(v / "final") for k, v in runs.items()}}.items():
        path = resolve_model_path(path)
        model = KeyeVL.from_pretrained(path, torch_dtype="float32")
        res = greedy_accuracy(model, KeyeProcessor.from_pretrained(path), prompts, scorer, max_new_tokens=16,
                              batch_size=25, samples=samples, seed=0, per_prompt=True)
        tables[name] = res["per_prompt"]
        print(f"final comparison: {name} greedy {res['accuracy']:.3f} avg@{samples} {res['sampled_accuracy']:.3f}",
              flush=True)
    result = {"samples": samples, "n": len(prompts),
              "paired": {k: paired(tables["start"], tables[k], kinds) for k in runs},
              # the question the RLEP paper asks: the runs against each other, on the same questions and seed
              "versus": ({"rlep - grpo": paired(tables["grpo"], tables["rlep"], kinds)}
                         if {"grpo", "rlep"} <= set(tables) else {}),
              "per_question": tables}
    (out / "final_comparison.json").write_text(json.dumps(result, indent=2))
    return result


def _pct(se: float | None) -> str:
    return "n/a" if se is None else f"{100 * se:.1f}"


def final_markdown(result: dict[str, Any]) -> str:
    """The paired final comparison as a table: start -> run (difference +- standard error), in %; then,
    when the result has them (``versus``), RLEP against GRPO as ``GRPO -> RLEP`` rows."""
    k = result["samples"]
    lines = [f"| run | questions | greedy % | avg@{k} % |", "|---|---|---|---|"]
    named = [(name.upper(), groups) for name, groups in result["paired"].items()]
    named += [("RLEP vs GRPO (GRPO -> RLEP)", groups) for groups in result.get("versus", {}).values()]
    for label, groups in named:
        for group, row in groups.items():
            cells = [f"{100 * row[m]['start']:.1f} -> {100 * row[m]['run']:.1f} ({100 * row[m]['diff']:+.1f} "
                     f"+- {_pct(row[m]['se'])})" for m in ("greedy", "sampled")]
            lines.append(f"| {label} | {group} ({row['n']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="keye-tiny", help="the SFT start (a checkpoint dir or keye-tiny)")
    ap.add_argument("--data", default="data/synth/train.jsonl", help="source of the RL questions")
    ap.add_argument("--test", default="data/synth/test.jsonl", help="held-out manifest for the curves")
    ap.add_argument("--questions", type=int, default=2000, help="RL questions (the first rows of --data of --kind)")
    ap.add_argument("--kind", default="all", choices=["numeric", "mc", "all"],
                    help="answer kind of the RL questions")
    ap.add_argument("--n", type=int, default=8, help="answers sampled per question for the pool")
    ap.add_argument("--steps", type=int, default=None, help="RL steps of each run (default: the configs')")
    ap.add_argument("--out", default="runs/rl_experiment")
    ap.add_argument("--final-samples", type=int, default=8,
                    help="answers sampled per held-out question for the paired final comparison (0: skip it)")
    ap.add_argument("overrides", nargs="*", help="dot-list overrides for both runs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(args.data)
    # The question set sits next to its source so relative media paths keep resolving.
    questions = src.parent / f"rl_train_{args.kind}_{args.questions}.jsonl"
    if not questions.is_file():
        rows = [r for r in src.read_text().splitlines()
                if r.strip() and args.kind in ("all", json.loads(r).get("answer_kind"))][: args.questions]
        if not rows:
            raise SystemExit(f"{src}: no questions of answer kind {args.kind!r}")
        questions.write_text("\n".join(rows) + "\n")
    pool = out / "pool.jsonl"
    if not pool.is_file():
        run([sys.executable, "-m", "keye", "rlep", "collect", "--policy", args.policy, "--data", str(questions),
             "--n", str(args.n), "--temperature", "1.0", "--top-p", "1.0", "--max-new-tokens", "16",
             "--out", str(pool)])
    common = [f"model.path={args.policy}", f"data.manifest={questions}", f"eval.manifest={args.test}"]
    if args.steps:
        common.append(f"train.steps={args.steps}")
    curves = {}
    for name, extra in (("grpo", []), ("rlep", [f"replay.pool={pool}"])):
        run_dir = out / name
        if not (run_dir / "summary.json").is_file():
            run([sys.executable, "-m", "keye", "train", "rlep", "--config", f"training/configs/tiny_synth_{name}.yaml",
                 *common, *extra, f"checkpoint.out_dir={run_dir}", *args.overrides])
        curves[name] = json.loads((run_dir / "eval_curve.json").read_text())
    summary = compare(curves["grpo"], curves["rlep"])
    has_sampled = all("sampled_accuracy" in c for curve in curves.values() for c in curve)
    sampled = compare(curves["grpo"], curves["rlep"], "sampled_accuracy") if has_sampled else None
    (out / "report.json").write_text(json.dumps({"summary": summary, "sampled_summary": sampled, **curves}, indent=2))
    md = markdown(summary, curves["grpo"], curves["rlep"], sampled)
    if args.final_samples > 0:
        final_path = out / "final_comparison.json"
        final = (json.loads(final_path.read_text()) if final_path.is_file() else
                 final_comparison(args.policy, {n: out / n for n in ("grpo", "rlep")}, Path(args.test),
                                  args.final_samples, out))
        md += ("\nFinal checkpoints vs the SFT start on every held-out question, paired per question "
               f"(avg@{final['samples']} at temperature 1, one sampling seed):\n\n" + final_markdown(final))
    (out / "report.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
