"""AutoThink on keye-tiny: does the model learn *when* to think? One resumable command, one report.

Stages, each skipped when its output exists (``--from-stage S`` deletes S's output and every later one's
and runs them again):

  data      the mode-tagged synthetic set (``keye.data.synth`` with ``modes=True``): ``--train`` samples
            from the build seed (``--seed``, three SFT rows each: /think, /no_think, auto; the think traces'
            captions name where each object is, as keye-tiny's build captions, unless ``--no-places``) and a held-out
            test split of ``--test`` questions from a seed keye-tiny never saw (``--test-seed``); the auto
            rows' decisions follow ``--auto-labels``: ``type`` (default: think on the stepwise question
            types only) or ``mixed`` (each sample 50/50, so the cold start takes both decisions on every
            type and RL's groups can compare them)
  init      keye-tiny with ``<analysis>`` and ``</analysis>`` added to its tokenizer (two of the
            embedding's spare rows; the byte BPE spells each tag in 8 tokens otherwise, which would cost
            the auto mode 16 tokens of tags per reply)
  sft       ``keye train sft --config training/configs/tiny_autothink_sft.yaml`` on the three-mode rows
  eval_sft  the held-out questions answered greedily in think, no_think and auto mode (``keye eval synth
            --mode M``, one run folder per mode in ``<out>/evals/sft``)
  rl        AutoThink RL (``keye train rlep --config training/configs/tiny_autothink_rl.yaml``,
            ``algorithm.autothink.enabled=true``) from the SFT checkpoint; skipped with a message while
            ``keye.rl.algorithms.autothink`` does not exist; by default on the SFT's own training questions, with
            ``--rl-seed S`` on ``--rl-questions`` new ones drawn from seed S (``<out>/rl_data``)
  eval_rl   the held-out evaluation of the RL checkpoint
  eval_helps  each checkpoint's think and no_think answers on a second held-out split (``--helps-test``
            questions from ``--helps-seed``), which alone decides the question types where thinking helps:
            auto's think rate is then compared on the first split, so the same answers never both pick the
            types and measure the rate (``--helps-test 0``: the types are judged on the first split, as
            before 2026-12-05)
  report    ``<out>/report.json`` and a markdown table (printed and written to ``<out>/report.md``)

Measured per checkpoint and mode, from ``keye eval synth``'s records: accuracy (its scoring of the reply's
answer part, as split by :func:`keye.processing.chat.parse_response`), think rate (share of replies with a non-empty think
block), mean reply tokens (generated tokens, the closing ``<|im_end|>`` included), all per question type.
The report compares auto with the better fixed mode (paired per question: mean difference and its
standard error, sample std / sqrt(n)), divides auto's mean reply tokens by always-think's, and splits the
question types by whether thinking helps (think accuracy minus no_think accuracy > 0, on the second held-out
split of ``eval_helps``) to compare auto's think rate on the held-out set between the two groups.

Scale (sized for a 2-core CPU): 1,500 training samples (4,500 rows), 300 held-out questions, 800 SFT
steps, 200 RL steps of 8 questions; ~25 min in all here on one thread alone (data 22 s, SFT 640 s, RL 755 s,
each evaluation ~30 s; two runs side by side on the two cores: ~32 min each, eval_helps ~60 s). The tables of
docs/experiments/autothink.md are ``<out>/report.md``.

Usage:
  python training/autothink_experiment.py                       # the experiment, runs/autothink
  python training/autothink_experiment.py --quick --out /tmp/at # seconds: a few questions, 2 SFT steps
  python training/autothink_experiment.py --from-stage eval_sft # redo the evaluations and the report
  python training/autothink_experiment.py --auto-labels mixed --extra-type when_sum=4 --out runs/autothink_sum
                                                                # with a two-step type (docs/autothink.md)
Extra ``key=value`` arguments are dot-list overrides of the RL run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STAGES = ("data", "init", "sft", "eval_sft", "rl", "eval_rl", "eval_helps", "report")
HELPS_MODES = ("think", "no_think")
EVAL_MODES = ("think", "no_think", "auto")
ANALYSIS_TOKENS = ("<analysis>", "</analysis>")


# ------------------------------------------------------------------------------------------------ stages


def run(cmd: list[str]) -> None:
    """Run a command from the repository root, echoing it; a failure stops the experiment."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def stage_outputs(out: Path) -> dict[str, list[Path]]:
    """What each stage writes (the stage is done when its first path exists)."""
    return {
        "data": [out / "data" / "DONE", out / "data"],
        "init": [out / "init" / "DONE", out / "init"],
        "sft": [out / "sft" / "final" / "model.safetensors", out / "sft"],
        "eval_sft": [out / "eval_sft.json", out / "evals" / "sft"],
        "rl": [out / "rl" / "final" / "model.safetensors", out / "rl", out / "rl_skipped.json", out / "rl_data"],
        "eval_rl": [out / "eval_rl.json", out / "evals" / "rl"],
        "eval_helps": [out / "eval_helps.json", out / "evals" / "helps", out / "helps_data"],
        "report": [out / "report.json", out / "report.md"],
    }


def reset_from(out: Path, stage: str) -> None:
    """Delete the outputs of ``stage`` and every later stage (``--from-stage``)."""
    if stage not in STAGES:
        raise SystemExit(f"--from-stage: unknown stage {stage!r} (one of {', '.join(STAGES)})")
    outputs = stage_outputs(out)
    for s in STAGES[STAGES.index(stage):]:
        for p in outputs[s]:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()


def make_data(out: Path, train: int, test: int, seed: int, test_seed: int, workers: int,
              auto_labels: str = "type", extra_types: dict[str, float] | None = None, places: bool = True) -> None:
    """The mode-tagged training rows (``train_modes.jsonl``, auto rows labelled by ``auto_labels``, see
    :func:`keye.data.synth.generate_split`) and the held-out test split (``test/test.jsonl`` from
    ``test_seed``; its labels are never trained on, so it keeps the default labelling and stays the same
    held-out set whatever ``auto_labels``). ``extra_types`` (opt-in question types and weights, e.g.
    ``{"when_gap": 3.0}``) applies to both splits. ``places`` writes the think traces' captions with place
    words (:func:`keye.data.synth.describe`), as keye-tiny's build captions them; questions and answers do
    not depend on it."""
    from keye.data.synth import generate_split

    data = out / "data"
    generate_split(data, "train", train, seed=seed, workers=workers, modes=True, auto_labels=auto_labels,
                   extra_types=extra_types, places=places)
    generate_split(data / "test", "test", test, seed=test_seed, workers=workers, modes=True, extra_types=extra_types,
                   places=places)
    (data / "DONE").write_text(json.dumps({"train": train, "test": test, "seed": seed, "test_seed": test_seed,
                                           "auto_labels": auto_labels, "extra_types": extra_types,
                                           "places": places}))


def make_rl_data(out: Path, n: int, seed: int, workers: int, extra_types: dict[str, float] | None = None) -> Path:
    """The RL questions when they come from their own seed (``--rl-seed``): ``n`` plain questions (no mode
    rows; the synthetic ``train`` split of that seed) in ``<out>/rl_data/train.jsonl``, with the same ``extra_types`` as the other splits. Questions the SFT
    never saw: on its own training questions the SFT checkpoint has partly memorised the direct answers, which
    hides the advantage thinking has on new clips (docs/experiments/autothink.md). Reused when already
    complete."""
    from keye.data.synth import generate_split

    data = out / "rl_data"
    if not (data / "DONE").is_file():
        generate_split(data, "train", n, seed=seed, workers=workers, extra_types=extra_types)
        (data / "DONE").write_text(json.dumps({"questions": n, "seed": seed, "extra_types": extra_types}))
    return data / "train.jsonl"


def make_helps_data(out: Path, n: int, seed: int, workers: int, extra_types: dict[str, float] | None = None) -> Path:
    """The second held-out split (``--helps-test`` questions of seed ``--helps-seed``'s test split, same
    ``extra_types``) in ``<out>/helps_data/test.jsonl``; reused when complete."""
    from keye.data.synth import generate_split

    data = out / "helps_data"
    if not (data / "DONE").is_file():
        generate_split(data, "test", n, seed=seed, workers=workers, extra_types=extra_types)
        (data / "DONE").write_text(json.dumps({"questions": n, "seed": seed, "extra_types": extra_types}))
    return data / "test.jsonl"


def make_init(out: Path, policy: str) -> None:
    """Copy ``policy`` to ``<out>/init`` and add the analysis tags to its tokenizer as ordinary (not
    special, so decoding keeps them) tokens, taking embedding rows the checkpoint has but its tokenizer
    does not use. Raises SystemExit when there are no spare rows."""
    from tokenizers import AddedToken, Tokenizer

    from keye.tiny import resolve_model_path

    src = Path(resolve_model_path(policy))
    dest = out / "init"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANALYSIS_TOKENS])
    vocab = json.loads((dest / "config.json").read_text())["vocab_size"]
    ids = [tok.token_to_id(t) for t in ANALYSIS_TOKENS]
    if any(i is None or i >= vocab for i in ids):
        raise SystemExit(f"{src}: no spare embedding rows for {ANALYSIS_TOKENS} (vocab_size {vocab}, ids {ids})")
    tok.save(str(dest / "tokenizer.json"))
    (dest / "DONE").write_text(json.dumps({"from": str(src), "added": dict(zip(ANALYSIS_TOKENS, ids))}))


def rl_available() -> bool:
    """True when the AutoThink RL code is in place: ``keye.rl.algorithms.autothink.AutoThinkConfig`` exists and the
    RL recipe's ``algorithm`` section has an ``autothink`` field."""
    if importlib.util.find_spec("keye.rl.algorithms.autothink") is None:
        return False
    import dataclasses
    from typing import get_type_hints

    from keye.rl.algorithms import autothink
    from keye.rl.config import RLEPConfig

    algo_cls = get_type_hints(RLEPConfig).get("algorithm")
    return hasattr(autothink, "AutoThinkConfig") and algo_cls is not None and any(
        f.name == "autothink" for f in dataclasses.fields(algo_cls))


# ---------------------------------------------------------------------------------------------- evaluation


def evaluate(checkpoint: Path, test: Path, modes: tuple[str, ...], *, max_new_tokens: int,
             batch_size: int, out: Path) -> dict[str, Any]:
    """Greedy answers of ``checkpoint`` to every question of the manifest ``test`` in each mode of
    ``modes``, by ``keye eval synth --mode M`` run in this process (the product's evaluation: its prompts,
    scoring and per-mode records; each run's files stay in ``out/<mode>``, and a mode whose
    ``report.json`` exists is not run again). Returns ``{"checkpoint", "n", "records": [...]}``, one record
    per (question, mode): ``id``, ``question_type``, ``mode`` (requested), ``used`` (:func:`parse_response`
    mode of the reply), ``thought`` (non-empty think block), ``tokens`` (generated, EOS included),
    ``correct`` and ``reply``.

    Raises:
        RuntimeError: an evaluation run whose files do not cover the same questions in every mode.
    """
    from keye.cli import main as keye_main
    from keye.processing.chat import parse_response

    records = []
    ids: list[str] | None = None
    for mode in modes:
        run_dir = out / mode
        if not (run_dir / "report.json").is_file():
            argv = ["eval", "synth", "--model", str(checkpoint), "--data", str(test), "--mode", mode,
                    "--max-new-tokens", str(max_new_tokens), "--batch-size", str(batch_size), "--out", str(run_dir)]
            print("+ keye", " ".join(argv), flush=True)
            if keye_main(argv) != 0:  # in this process: a subprocess per mode would pay keye's import each time
                raise RuntimeError(f"keye {' '.join(argv)} failed")
        preds = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines() if line]
        judged = {j["id"]: j["correct"] for j in map(json.loads, (run_dir / "judgements.jsonl").read_text().splitlines())}
        thought = {m["id"]: m["thought"] for m in map(json.loads, (run_dir / "modes.jsonl").read_text().splitlines())}
        order = [p["id"] for p in preds]
        if ids is None:
            ids = order
        if sorted(order) != sorted(ids) or set(judged) != set(ids) or set(thought) != set(ids):
            raise RuntimeError(f"{run_dir}: the evaluation files do not cover the same questions as the other modes")
        for p in preds:
            records.append({"id": p["id"], "question_type": p["question_type"], "mode": mode,
                            "used": parse_response(p["raw_output"]).mode, "thought": bool(thought[p["id"]]),
                            "tokens": int(p["reply_tokens"]), "correct": bool(judged[p["id"]]),
                            "reply": p["raw_output"]})
    return {"checkpoint": str(checkpoint), "n": len(ids or []), "records": records}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: ``accuracy``, ``think_rate``, ``mean_tokens``, ``n`` overall and per question type."""
    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in records}):
        rs = [r for r in records if r["mode"] == mode]

        def row(group: list[dict[str, Any]]) -> dict[str, Any]:
            return {"n": len(group), "accuracy": _mean([float(r["correct"]) for r in group]),
                    "think_rate": _mean([float(r["thought"]) for r in group]),
                    "mean_tokens": _mean([float(r["tokens"]) for r in group])}

        out[mode] = {**row(rs), "question_type": {t: row([r for r in rs if r["question_type"] == t])
                                                  for t in sorted({r["question_type"] for r in rs})}}
    return out


def paired(a: dict[str, bool], b: dict[str, bool]) -> dict[str, float]:
    """Mean per-question difference a - b (correct as 0/1, same question ids) and its standard error
    (sample std of the differences / sqrt(n); 0 for one question), by :func:`keye.eval.modes.paired_diff`.
    Raises ValueError when the id sets differ or are empty (the experiment answers every question in every
    mode, so a partial pairing means a broken evaluation)."""
    from keye.eval.modes import paired_diff

    if set(a) != set(b) or not a:
        raise ValueError("paired comparison needs the same, non-empty set of questions on both sides")
    res = paired_diff([{"id": i, "correct": v} for i, v in a.items()], [{"id": i, "correct": v} for i, v in b.items()])
    return {"diff": res["diff"], "se": res["se"] if res["se"] is not None else 0.0, "n": res["n"]}


def analyse(ev: dict[str, Any], helps_ev: dict[str, Any] | None = None, helps_source: str = "") -> dict[str, Any]:
    """The acceptance figures of one evaluated checkpoint (see the module docstring). With ``helps_ev``
    (the same checkpoint's think and no_think records on another split, ``helps_source`` naming it) the
    types where thinking helps are judged there, and only auto's think rates come from ``ev``; without it
    both come from ``ev``."""
    recs = ev["records"]
    summ = summarise(recs)
    by_mode = {m: {r["id"]: r["correct"] for r in recs if r["mode"] == m} for m in EVAL_MODES}
    better = max(("think", "no_think"), key=lambda m: summ[m]["accuracy"])
    vs = paired(by_mode["auto"], by_mode[better])
    ratio = summ["auto"]["mean_tokens"] / summ["think"]["mean_tokens"]
    types = sorted(summ["auto"]["question_type"])
    helps = {t: summ["think"]["question_type"][t]["accuracy"] - summ["no_think"]["question_type"][t]["accuracy"]
             for t in types}
    same_set = dict(helps)
    if helps_ev is not None:
        other = summarise(helps_ev["records"])
        # a type the other split never asked counts as one where thinking does not help
        helps = {t: (other["think"]["question_type"][t]["accuracy"] - other["no_think"]["question_type"][t]["accuracy"])
                 if t in other["think"]["question_type"] else 0.0 for t in types}
    qtype = {r["id"]: r["question_type"] for r in recs}
    auto = [r for r in recs if r["mode"] == "auto"]
    help_rs = [r for r in auto if helps[qtype[r["id"]]] > 0]
    other_rs = [r for r in auto if helps[qtype[r["id"]]] <= 0]
    rate_help = _mean([float(r["thought"]) for r in help_rs])
    rate_other = _mean([float(r["thought"]) for r in other_rs])
    return {
        "summary": summ,
        "better_fixed_mode": better,
        "auto_minus_better_fixed": vs,
        "token_ratio_auto_over_think": ratio,
        # where auto's tokens go: replies that chose to think vs those that answered directly (the latter
        # still pay for the analysis block)
        "auto_mean_tokens_by_choice": {
            "think": _mean([float(r["tokens"]) for r in auto if r["thought"]]),
            "direct": _mean([float(r["tokens"]) for r in auto if not r["thought"]])},
        "think_helps_by_type": helps,
        "think_helps_judged_on": helps_source if helps_ev is not None else "the held-out set itself",
        "think_helps_by_type_same_set": same_set,
        "helps_split_n": helps_ev["n"] if helps_ev is not None else None,
        "auto_think_rate_by_type": {t: summ["auto"]["question_type"][t]["think_rate"] for t in types},
        "auto_think_rate_where_thinking_helps": {"rate": rate_help, "n": len(help_rs),
                                                 "types": [t for t in types if helps[t] > 0]},
        "auto_think_rate_where_it_does_not": {"rate": rate_other, "n": len(other_rs),
                                              "types": [t for t in types if helps[t] <= 0]},
        "targets": {
            "auto_within_1pt_of_better_fixed": vs["diff"] >= -0.01,
            "auto_tokens_le_0.6x_think": ratio <= 0.6,
            "auto_thinks_more_where_it_helps": bool(help_rs and other_rs and rate_help > rate_other),
        },
    }


def markdown(results: dict[str, dict[str, Any]], n: int) -> str:
    """The report table (docs/experiments/autothink.md): per checkpoint, each mode's accuracy / think rate /
    mean reply tokens, then auto against the better fixed mode and the think-rate split; then auto's think rate
    per question type."""
    pct = lambda v: "-" if v is None or v != v else f"{100 * v:.1f}"  # noqa: E731
    num = lambda v: "-" if v is None or v != v else f"{v:.1f}"  # noqa: E731  (NaN: no reply of that kind)
    lines = [f"Held-out set: {n} questions (unseen seed), greedy.", "",
             "| checkpoint | mode | accuracy % | think rate % | mean reply tokens |", "|---|---|---|---|---|"]
    for name, res in results.items():
        for mode in EVAL_MODES:
            s = res["summary"][mode]
            lines.append(f"| {name} | {mode} | {pct(s['accuracy'])} | {pct(s['think_rate'])} | "
                         f"{s['mean_tokens']:.1f} |")
    lines += ["", "| checkpoint | auto - better fixed (pp, +- SE) | auto / think tokens (auto replies that think "
              "/ answer directly) | auto think rate where thinking helps % | where it does not % |",
              "|---|---|---|---|---|"]
    for name, res in results.items():
        vs, h, o = res["auto_minus_better_fixed"], res["auto_think_rate_where_thinking_helps"], \
            res["auto_think_rate_where_it_does_not"]
        by = res["auto_mean_tokens_by_choice"]
        lines.append(f"| {name} | {100 * vs['diff']:+.1f} +- {100 * vs['se']:.1f} (vs {res['better_fixed_mode']}) | "
                     f"{res['token_ratio_auto_over_think']:.2f} ({num(by['think'])} / {num(by['direct'])} tokens) | "
                     f"{pct(h['rate'])} (n={h['n']}) | {pct(o['rate'])} (n={o['n']}) |")
    last = list(results)[-1]
    res = results[last]
    types = list(res["think_helps_by_type"])
    judged = res.get("think_helps_judged_on", "the held-out set itself")
    lines += ["", f"Where thinking helps (think - no_think accuracy > 0 per question type) is judged on {judged}.", "",
              f"Per question type ({last}): think - no_think accuracy (pp) and auto's think rate (%)", ""]
    if res.get("helps_split_n"):
        lines += ["| type | n | think - no_think | think - no_think (other split) | auto think rate |",
                  "|---|---|---|---|---|"]
        for t in types:
            lines.append(f"| {t} | {res['summary']['auto']['question_type'][t]['n']} | "
                         f"{100 * res['think_helps_by_type_same_set'][t]:+.1f} | {100 * res['think_helps_by_type'][t]:+.1f} | "
                         f"{pct(res['auto_think_rate_by_type'][t])} |")
    else:
        lines += ["| type | n | think - no_think | auto think rate |", "|---|---|---|---|"]
        for t in types:
            lines.append(f"| {t} | {res['summary']['auto']['question_type'][t]['n']} | "
                         f"{100 * res['think_helps_by_type'][t]:+.1f} | {pct(res['auto_think_rate_by_type'][t])} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) the experiment; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/autothink")
    ap.add_argument("--policy", default="keye-tiny", help="the start checkpoint (a directory or keye-tiny)")
    ap.add_argument("--train", type=int, default=1500, help="training samples (three SFT rows each)")
    ap.add_argument("--test", type=int, default=300, help="held-out questions")
    ap.add_argument("--seed", type=int, default=0, help="training seed (keye-tiny's build seed)")
    ap.add_argument("--test-seed", type=int, default=303, help="held-out seed (never trained on)")
    ap.add_argument("--helps-seed", type=int, default=404,
                    help="seed of the second held-out split that judges where thinking helps")
    ap.add_argument("--helps-test", type=int, default=300,
                    help="questions of that split (0: judge on the held-out set itself)")
    ap.add_argument("--sft-steps", type=int, default=800, help="SFT steps (~3.4 epochs of the 4,500 rows)")
    ap.add_argument("--rl-steps", type=int, default=200, help="AutoThink RL steps (8 questions each)")
    ap.add_argument("--rl-seed", type=int, default=None,
                    help="draw the RL questions from this seed instead of the SFT's training questions")
    ap.add_argument("--rl-questions", type=int, default=1500, help="RL questions drawn with --rl-seed")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="reply budget in evaluation and RL")
    ap.add_argument("--batch-size", type=int, default=25, help="questions per generation call in evaluation")
    ap.add_argument("--workers", type=int, default=1, help="processes rendering the clips")
    ap.add_argument("--auto-labels", choices=("type", "mixed"), default="type",
                    help="the cold start's auto decisions: type (think on the stepwise types only) or mixed "
                         "(each sample 50/50, so both decisions are explored on every type)")
    ap.add_argument("--extra-type", action="append", default=[], metavar="TYPE=WEIGHT",
                    help="also draw an opt-in question type in both splits, e.g. when_gap=3 (a two-step question "
                         "whose think trace writes the subtraction out); repeatable")
    ap.add_argument("--no-places", dest="places", action="store_false",
                    help="think traces without place words (the runs before 2026-12-05; keye-tiny's build "
                         "captions with them, build_tiny.py --no-caption-places)")
    ap.add_argument("--quick", action="store_true",
                    help="test-sized: 12 training samples, 6 questions, 2 SFT steps, 1 RL step")
    ap.add_argument("--from-stage", choices=STAGES, default=None, help="redo this stage and every later one")
    ap.add_argument("overrides", nargs="*", help="dot-list overrides of the RL run")
    args = ap.parse_args(argv)
    from keye.data.cli import parse_type_weights

    extra = parse_type_weights(args.extra_type)  # a malformed TYPE=WEIGHT fails before any stage runs
    if args.rl_seed is not None and args.rl_seed in (args.seed, args.test_seed):
        ap.error(f"--rl-seed {args.rl_seed} must differ from --seed ({args.seed}) and --test-seed ({args.test_seed}): "
                 "the RL questions are meant to be new to the SFT and the held-out set is never trained on")
    if args.helps_test and args.helps_seed in (args.seed, args.test_seed, args.rl_seed):
        ap.error(f"--helps-seed {args.helps_seed} must differ from --seed, --test-seed and --rl-seed: its split "
                 "judges the types on questions neither trained on nor used for the other figures")
    if args.helps_test < 0:
        ap.error(f"--helps-test must be >= 0, got {args.helps_test}")
    if args.rl_questions < 1:
        ap.error(f"--rl-questions must be >= 1, got {args.rl_questions}")
    if args.quick:
        args.train, args.test, args.sft_steps, args.rl_steps, args.workers = 12, 6, 2, 1, 0
        args.helps_test = min(args.helps_test, 6)
        args.rl_questions = min(args.rl_questions, 12)
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO / out
    out.mkdir(parents=True, exist_ok=True)
    if args.from_stage:
        reset_from(out, args.from_stage)
    outputs = stage_outputs(out)
    done = lambda s: outputs[s][0].exists()  # noqa: E731
    t0 = time.perf_counter()
    log: dict[str, Any] = json.loads((out / "stages.json").read_text()) if (out / "stages.json").is_file() else {}

    def mark(stage: str, started: float, **extra: Any) -> None:
        log[stage] = {"seconds": round(time.perf_counter() - started, 1), **extra}
        (out / "stages.json").write_text(json.dumps(log, indent=1))

    def skip(stage: str) -> bool:
        if done(stage):
            print(f"[{stage}] done already ({outputs[stage][0]}), skipped", flush=True)
            return True
        print(f"[{stage}] running", flush=True)
        return False

    if not skip("data"):
        s = time.perf_counter()
        make_data(out, args.train, args.test, args.seed, args.test_seed, args.workers, args.auto_labels, extra,
                  args.places)
        mark("data", s, train=args.train, test=args.test, auto_labels=args.auto_labels, extra_types=extra,
             places=args.places)
    if not skip("init"):
        s = time.perf_counter()
        make_init(out, args.policy)
        mark("init", s)
    test = out / "data" / "test" / "test.jsonl"
    if not skip("sft"):
        s = time.perf_counter()
        run([sys.executable, "-m", "keye", "train", "sft", "--config", "training/configs/tiny_autothink_sft.yaml",
             f"model.path={out / 'init'}", f"data.manifest={out / 'data' / 'train_modes.jsonl'}",
             f"checkpoint.out_dir={out / 'sft'}", f"train.max_steps={args.sft_steps}",
             *(["train.warmup_steps=0", "log.every=1"] if args.quick else [])])
        mark("sft", s, steps=args.sft_steps)
    ev_kw = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    if not skip("eval_sft"):
        s = time.perf_counter()
        ev = evaluate(out / "sft" / "final", test, EVAL_MODES, out=out / "evals" / "sft", **ev_kw)
        outputs["eval_sft"][0].write_text(json.dumps(ev))
        mark("eval_sft", s)
    if not skip("rl"):
        s = time.perf_counter()
        if rl_available():
            rl_manifest = out / "data" / "train.jsonl"
            if args.rl_seed is not None:
                rl_manifest = make_rl_data(out, args.rl_questions, args.rl_seed, args.workers, extra)
            run([sys.executable, "-m", "keye", "train", "rlep", "--config", "training/configs/tiny_autothink_rl.yaml",
                 f"model.path={out / 'sft' / 'final'}", f"data.manifest={rl_manifest}",
                 f"checkpoint.out_dir={out / 'rl'}", f"train.steps={args.rl_steps}",
                 f"rollout.max_new_tokens={args.max_new_tokens}",
                 *(["eval.manifest=null", "data.prompts_per_step=2"] if args.quick else []), *args.overrides])
            mark("rl", s, steps=args.rl_steps, questions=str(rl_manifest.relative_to(out)), rl_seed=args.rl_seed)
        else:
            msg = "keye.rl.algorithms.autothink is not available yet: AutoThink RL skipped (pending); post-SFT figures only"
            print(f"[rl] {msg}", flush=True)
            outputs["rl"][2].write_text(json.dumps({"skipped": msg}))
    if outputs["rl"][0].exists() and not skip("eval_rl"):
        s = time.perf_counter()
        ev = evaluate(out / "rl" / "final", test, EVAL_MODES, out=out / "evals" / "rl", **ev_kw)
        outputs["eval_rl"][0].write_text(json.dumps(ev))
        mark("eval_rl", s)

    checkpoints = {"sft": out / "sft" / "final"}
    if outputs["eval_rl"][0].exists():
        checkpoints["rl"] = out / "rl" / "final"
    helps_on = f"a second held-out split ({args.helps_test} questions, seed {args.helps_seed})"
    if args.helps_test and not skip("eval_helps"):
        s = time.perf_counter()
        helps_test = make_helps_data(out, args.helps_test, args.helps_seed, args.workers, extra)
        evs = {name: evaluate(ckpt, helps_test, HELPS_MODES, out=out / "evals" / "helps" / name, **ev_kw)
               for name, ckpt in checkpoints.items()}
        outputs["eval_helps"][0].write_text(json.dumps({"split": helps_on, **evs}))
        mark("eval_helps", s, questions=args.helps_test, seed=args.helps_seed)
    helps: dict[str, Any] = {}
    if args.helps_test and outputs["eval_helps"][0].exists():
        helps = json.loads(outputs["eval_helps"][0].read_text())
        if set(checkpoints) - set(helps):  # RL finished after the split was judged: judge it for RL too
            helps["rl"] = evaluate(checkpoints["rl"], out / "helps_data" / "test.jsonl", HELPS_MODES,
                                   out=out / "evals" / "helps" / "rl", **ev_kw)
            outputs["eval_helps"][0].write_text(json.dumps(helps))
    results = {"after SFT": analyse(json.loads(outputs["eval_sft"][0].read_text()), helps.get("sft"),
                                    helps.get("split", ""))}
    if "rl" in checkpoints:
        results["after AutoThink RL"] = analyse(json.loads(outputs["eval_rl"][0].read_text()), helps.get("rl"),
                                                helps.get("split", ""))
    n = json.loads(outputs["eval_sft"][0].read_text())["n"]
    report = {"config": {k: v for k, v in vars(args).items() if k != "from_stage"}, "n_test": n,
              "rl": "done" if "after AutoThink RL" in results else "pending (keye.rl.algorithms.autothink not available)",
              "stages": log, "results": results}
    md = markdown(results, n)
    outputs["report"][0].write_text(json.dumps(report, indent=1))
    outputs["report"][1].write_text(md)
    print(md)
    print(f"report: {outputs['report'][0]} ({time.perf_counter() - t0:.0f} s this invocation)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
