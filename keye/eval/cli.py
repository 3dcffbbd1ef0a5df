"""``keye eval``: run a benchmark on a model, or re-score stored predictions.

::

    keye eval mmmu      --model PATH --split validation --mode think --out runs/mmmu
    keye eval mathvista --model PATH --split testmini --out runs/mathvista [--judge-url URL]
    keye eval videoqa   --model PATH --data videomme.jsonl --out runs/videomme
    keye eval synth     --model PATH --data data/synth/test.jsonl --out runs/synth
    keye eval score mathvista runs/mathvista/predictions.jsonl
    keye eval score mmmu total_val_output.json --answers answer_dict_val.json
    keye eval synth     --model PATH --data test.jsonl --mode auto --samples 8 --sampling keye --out runs/s8
    keye eval synth     --model PATH --data test.jsonl --mode auto --difficulty-from runs/s8/modes.json
    keye eval compare   runs/auto/modes.jsonl runs/think/modes.jsonl

A run writes ``<out>/predictions.jsonl`` (resumable), ``<out>/scores.json`` (the benchmark's own output),
``<out>/judgements.jsonl`` (per-item parse and verdict), ``<out>/report.{json,md}`` and the thinking-mode
breakdown (:mod:`keye.eval.modes`): ``<out>/modes.jsonl`` (per reply: mode used, verdict, tokens) and
``<out>/modes.json`` (the tables' numbers and per-question pass rates). Launch with
``torchrun --nproc-per-node N -m keye eval ...`` for data-parallel inference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError, KeyeInputError

BENCHMARKS = ("mmmu", "mathvista", "videoqa", "synth")
# The record field each benchmark's "thinking mode by ..." table groups by.
MODE_GROUP_KEYS = {"mmmu": "subject", "mathvista": "question_type", "videoqa": "duration", "synth": "question_type"}


# ------------------------------------------------------------------------------------------- parsers


def _add_model_args(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or hub id")
    p.add_argument("--out", default=default_out, help="run directory (predictions, scores, report)")
    p.add_argument(
        "--mode", choices=("think", "no_think", "auto"), default=None, help="Keye thinking mode switch (default: none, the model's own)"
    )
    p.add_argument("--batch-size", type=int, default=1, help="questions answered together")
    p.add_argument("--max-new-tokens", type=int, default=2048, help="answer budget in tokens")
    p.add_argument(
        "--sampling",
        choices=("greedy", "keye"),
        default="greedy",
        help="greedy (official) or Keye's sampling",
    )
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda:LOCAL_RANK when CUDA is available, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="weights dtype (default: the checkpoint's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_difficulty_args(p)


def _add_difficulty_args(p: argparse.ArgumentParser) -> None:
    from keye.eval.modes import DEFAULT_EDGES

    p.add_argument(
        "--difficulty-from",
        default=None,
        help="bucket questions by a reference run's pass rates: its modes.json, modes.jsonl, "
        "judgements.jsonl or predictions.jsonl (default: this run's own pass rates when it sampled "
        "several answers per question)",
    )
    p.add_argument(
        "--difficulty-edges",
        type=float,
        nargs=2,
        default=list(DEFAULT_EDGES),
        metavar=("LO", "HI"),
        help="pass-rate bucket edges: hard p < LO <= medium < HI <= easy (default 0.25 0.75)",
    )


def _add_judge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--judge-url", default=None, help="OpenAI-compatible endpoint for the official LLM extraction"
    )
    p.add_argument("--judge-model", default="gpt-4o-mini", help="model name sent to --judge-url")
    p.add_argument(
        "--judge-api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key"
    )
    p.add_argument("--quick-extract", action="store_true", help='official `The answer is "..."` shortcut')
    p.add_argument("--ignore-empty-extractions", action="store_true",
                   help="an empty extraction of a multiple-choice answer counts as no answer, not the nearest choice")


def add_commands(subparsers: Any) -> None:
    """Add ``keye eval {mmmu,mathvista,videoqa,synth,score,compare}`` to the ``keye`` command line."""
    ev = subparsers.add_parser("eval", help="evaluate a model on a benchmark, or re-score predictions")
    sub = ev.add_subparsers(dest="eval_command", metavar="BENCHMARK")
    ev.set_defaults(func=lambda args: (ev.print_help(), 2)[1])

    p = sub.add_parser("mmmu", help="MMMU (official prompts, parsing and aggregation)")
    _add_model_args(p, "runs/mmmu")
    p.add_argument("--split", default="validation", choices=("dev", "validation", "test"), help="MMMU split")
    p.add_argument("--data", default=None, help="local copy: directory of parquet files")
    p.add_argument("--subjects", nargs="*", default=None, help="only these subjects (default: all 30)")
    p.add_argument("--prompt-style", choices=("mmmu", "vlmevalkit"), default="mmmu",
                   help="the official MMMU prompts or VLMEvalKit's")
    p.add_argument("--image-mode", choices=("interleave", "first"), default="interleave",
                   help="interleave: each image where its <image k> stands (how Keye was evaluated); first: only image 1, before the text (the official LLaVA runner)")
    p.add_argument("--seed", type=int, default=42, help="seed of the official random fallback")
    p.set_defaults(func=cmd_mmmu)

    p = sub.add_parser("mathvista", help="MathVista (official query, extraction and scoring)")
    _add_model_args(p, "runs/mathvista")
    p.add_argument("--split", default="testmini", choices=("testmini", "test"), help="MathVista split")
    p.add_argument("--data", default=None, help="local copy: parquet directory or official JSON")
    _add_judge_args(p)
    p.set_defaults(func=cmd_mathvista)

    p = sub.add_parser("videoqa", help="Video-MME-style multiple choice over local videos")
    _add_model_args(p, "runs/videoqa")
    p.add_argument("--data", required=True, help="JSONL of questions (see keye.eval.videoqa)")
    p.add_argument("--subtitles", action="store_true", help="put the item's subtitles in the prompt")
    p.add_argument("--fps", type=float, default=None, help="video sampling rate handed to the processor")
    p.add_argument("--max-frames", type=int, default=None, help="frame budget handed to the processor")
    p.set_defaults(func=cmd_videoqa)

    p = sub.add_parser("synth", help="the synthetic video-QA set (accuracy per question type)")
    _add_model_args(p, "runs/synth")
    p.add_argument("--data", required=True, help="the set's JSONL manifest (keye data synth)")
    p.add_argument("--blank", action="store_true",
                   help="control run: every clip/image replaced by a blank one of the same size, fps and length "
                        "(a model that uses the pixels should fall to the majority-answer baseline)")
    p.add_argument("--samples", type=int, default=1,
                   help="sampled answers per question (needs --sampling keye); gives each question a pass rate "
                        "and the report accuracy by difficulty bucket")
    p.add_argument("--seed", type=int, default=None, help="torch seed set before sampling")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("score", help="re-score stored predictions (ours or the official JSON formats)")
    p.add_argument("benchmark", choices=BENCHMARKS, help="whose scorer to use")
    p.add_argument("predictions", help="predictions.jsonl, or an official output JSON")
    p.add_argument("--answers", default=None, help="MMMU answer key for an id->prediction JSON (eval only)")
    p.add_argument("--out", default=None, help="write scores and report here")
    p.add_argument("--model-id", default=None, help="model name for the report")
    p.add_argument("--reextract", action="store_true", help="MathVista: extract again even if stored")
    p.add_argument("--seed", type=int, default=42, help="MMMU: seed of the official random fallback")
    p.add_argument("--tokenizer", default=None,
                   help="count reply tokens with this model's tokenizer where the records have no counts")
    _add_judge_args(p)
    _add_difficulty_args(p)
    p.set_defaults(func=cmd_score)

    p = sub.add_parser(
        "compare",
        help="paired comparison of two runs on the same questions: accuracy difference with its paired "
        "standard error, and the ratio of mean reply tokens",
    )
    p.add_argument("a", help="run A: modes.jsonl / judgements.jsonl (with verdicts) or predictions.jsonl")
    p.add_argument("b", help="run B, same formats")
    p.add_argument("--benchmark", choices=BENCHMARKS, default="synth", help="scorer for predictions files")
    p.add_argument("--tokenizer", default=None,
                   help="count reply tokens with this model's tokenizer where the records have no counts")
    p.add_argument("--out", default=None, help="write the comparison as JSON to this file")
    p.set_defaults(func=cmd_compare)


def script_main(command: str, argv: list[str] | None = None) -> int:
    """Entry point of the thin ``eval/*.py`` scripts: ``keye eval <command> ...argv``."""
    from keye.cli import main

    return main(["eval", command, *(sys.argv[1:] if argv is None else argv)])


# ---------------------------------------------------------------------------------------------- glue


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from keye.eval.runner import KEYE_SAMPLING

    kwargs: dict[str, Any] = {
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "mode": args.mode,
    }
    if args.sampling == "keye":
        kwargs.update(KEYE_SAMPLING)
    return kwargs


def _run_config(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    keys = ("split", "data", "mode", "batch_size", "max_new_tokens", "sampling", "limit", "dtype")
    config = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    # Only runs that ask for them list the multi-sample / difficulty settings (others stay unchanged).
    if (getattr(args, "samples", 1) or 1) > 1:
        config["samples"] = args.samples
        config["seed"] = getattr(args, "seed", None)
    if getattr(args, "difficulty_from", None):
        config["difficulty_from"] = args.difficulty_from
    config.update(extra)
    return config


def _infer(
    args: argparse.Namespace,
    items: list[dict[str, Any]],
    to_conversation: Callable[[Mapping[str, Any]], list[dict[str, Any]]],
    to_record: Callable[[Mapping[str, Any], str, str], dict[str, Any]],
    engine: Any = None,
) -> list[dict[str, Any]] | None:
    """Run inference; returns the records on rank 0, None on the other ranks."""
    from keye.eval.runner import init_distributed, load_engine, run_inference

    samples = int(getattr(args, "samples", 1) or 1)
    if samples > 1 and args.sampling == "greedy":
        raise KeyeConfigError(
            f"--samples {samples} needs sampling (--sampling keye): greedy decoding gives every sample "
            "the same answer"
        )
    rank, world = init_distributed()
    if args.limit is not None:
        items = items[: args.limit]
    if samples > 1:
        from keye.eval.modes import expand_samples

        items = expand_samples(items, samples)
        base_record = to_record

        def to_record(item: Mapping[str, Any], raw: str, response: str) -> dict[str, Any]:
            rec = base_record(item, raw, response)
            return {**rec, "question_id": item["question_id"], "sample": item["sample"]}

    if getattr(args, "seed", None) is not None and samples > 1:
        import torch

        torch.manual_seed(args.seed)
    if engine is None:
        engine = load_engine(args.model, device=args.device, dtype=args.dtype, **_engine_kwargs(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = run_inference(
        items,
        engine=engine,
        to_conversation=to_conversation,
        to_record=to_record,
        out_path=out / "predictions.jsonl",
        batch_size=max(1, args.batch_size),
        rank=rank,
        world_size=world,
        progress=not args.no_progress,
    )
    return records if rank == 0 else None


def _write_judgements(out: Path, per_item: Mapping[str, Any]) -> None:
    with open(out / "judgements.jsonl", "w", encoding="utf-8") as f:
        for item_id, info in per_item.items():
            f.write(json.dumps({"id": item_id, **info}, ensure_ascii=False, default=str) + "\n")


def _tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer of ``--tokenizer MODEL`` (None when not given)."""
    name = getattr(args, "tokenizer", None)
    if not name:
        return None
    from keye.hub import resolve_model_path
    from keye.processing.processor import KeyeProcessor

    return KeyeProcessor.from_pretrained(resolve_model_path(name)).tokenizer


def _verdicts(benchmark: str, records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, bool]:
    """``{id: correct}`` of prediction records under ``benchmark``'s scorer (MathVista: rule extraction
    unless the arguments name a judge)."""
    from keye.eval.modes import correct_map

    if benchmark == "mmmu":
        per_item = _score_mmmu_records(records, int(getattr(args, "seed", 42) or 42))[3]
    elif benchmark == "mathvista":
        rules = argparse.Namespace(
            judge_url=getattr(args, "judge_url", None),
            judge_model=getattr(args, "judge_model", "gpt-4o-mini"),
            judge_api_key_env=getattr(args, "judge_api_key_env", "OPENAI_API_KEY"),
            quick_extract=getattr(args, "quick_extract", False),
            ignore_empty_extractions=getattr(args, "ignore_empty_extractions", False),
        )
        per_item = _score_mathvista_records(records, rules, reextract=False)[3]
    elif benchmark == "videoqa":
        per_item = _score_videoqa_records(records)[3]
    else:
        per_item = _score_synth_records(records)[3]
    return correct_map(per_item)


def _mode_section(
    benchmark: str,
    records: list[dict[str, Any]] | None,
    per_item: Mapping[str, Any] | None,
    args: argparse.Namespace,
    requested_mode: str | None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any], list[dict[str, Any]]] | None:
    """The thinking-mode tables, the ``modes.json`` document and the ``modes.jsonl`` rows of a scored run
    (None when the records carry no reply text, e.g. an id -> prediction file)."""
    from keye.eval import modes

    if not records or per_item is None or any(modes.reply_text(r) is None for r in records):
        return None
    group_key = MODE_GROUP_KEYS[benchmark]
    verdicts = modes.correct_map(per_item)
    rows = modes.scored_rows(records, verdicts, group_key=group_key, tokenizer=_tokenizer(args))
    own = modes.pass_rates(rows)
    source, rates = None, None
    if getattr(args, "difficulty_from", None):
        source = str(args.difficulty_from)
        rates = modes.load_pass_rates(
            args.difficulty_from, score=lambda recs: _verdicts(benchmark, recs, args)
        )
    elif any(e["samples"] > 1 for e in own.values()):
        source = "this run"
        rates = {q: e["pass_rate"] for q, e in own.items()}
    edges = getattr(args, "difficulty_edges", None) or list(modes.DEFAULT_EDGES)
    breakdown = modes.mode_breakdown(rows, requested_mode=requested_mode, rates=rates, edges=edges)
    doc = {"breakdown": breakdown, "difficulty_source": source, "pass_rates": own}
    return modes.breakdown_tables(breakdown, group_key), doc, rows


def _finish(
    out: Path | None,
    benchmark: str,
    model_id: str | None,
    config: Mapping[str, Any],
    overall: dict[str, Any],
    tables: Mapping[str, list[dict[str, Any]]],
    official: Any,
    per_item: Mapping[str, Any] | None,
    mode_section: tuple[dict[str, list[dict[str, Any]]], dict[str, Any], list[dict[str, Any]]] | None = None,
) -> None:
    from keye.eval.report import markdown_table, write_report

    print(markdown_table([overall]))
    if mode_section is not None:
        # The mode tables follow the benchmark's own tables, which stay as they were.
        tables = {**tables, **mode_section[0]}
    if out is None:
        for title, rows in tables.items():
            print(f"\n{title}\n{markdown_table(rows)}")
        return
    if mode_section is not None:
        for title, rows in mode_section[0].items():
            print(f"\n{title}\n{markdown_table(rows)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "scores.json").write_text(
        json.dumps(official, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if per_item is not None:
        _write_judgements(out, per_item)
    if mode_section is not None:
        (out / "modes.json").write_text(
            json.dumps(mode_section[1], indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        with open(out / "modes.jsonl", "w", encoding="utf-8") as f:
            for row in mode_section[2]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    paths = write_report(out, benchmark=benchmark, model_id=model_id, config=config, overall=overall,
                         tables=tables, official=official)
    print(f"report: {paths['md']}")


def _score_mmmu_records(records: list[dict[str, Any]], seed: int) -> tuple[Any, ...]:
    from keye.eval import mmmu
    from keye.eval.report import mmmu_report

    printable, per_item = mmmu.score_records(records, seed=seed)
    overall, tables = mmmu_report(printable, {k: v["correct"] for k, v in per_item.items()})
    return overall, tables, printable, per_item


def _judge(args: argparse.Namespace) -> Any:
    if not getattr(args, "judge_url", None):
        return None
    from keye.eval.mathvista import OpenAIJudge

    return OpenAIJudge(args.judge_url, model=args.judge_model, api_key=os.environ.get(args.judge_api_key_env))


def _score_mathvista_records(
    records: list[dict[str, Any]], args: argparse.Namespace, reextract: bool
) -> tuple[Any, ...]:
    from keye.eval import mathvista
    from keye.eval.report import mathvista_report

    scores, per_item = mathvista.score_records(
        records,
        judge=_judge(args),
        quick_extract=args.quick_extract,
        reextract=reextract,
        ignore_empty_extractions=args.ignore_empty_extractions,
    )
    overall, tables = mathvista_report(scores)
    return overall, tables, scores, per_item


def _score_videoqa_records(records: list[dict[str, Any]]) -> tuple[Any, ...]:
    from keye.eval import videoqa
    from keye.eval.report import videoqa_report

    result = videoqa.score_records(records)
    overall, tables = videoqa_report(result)
    per_item = result.pop("per_item")
    return overall, tables, result, per_item


def _score_synth_records(records: list[dict[str, Any]]) -> tuple[Any, ...]:
    from keye.eval import synth
    from keye.eval.report import synth_report

    result = synth.score_records(records)
    overall, tables = synth_report(result)
    per_item = result.pop("per_item")
    return overall, tables, result, per_item


# ------------------------------------------------------------------------------------------ commands


def cmd_mmmu(args: argparse.Namespace, engine: Any = None) -> int:
    """``keye eval mmmu``: load MMMU, answer, score with the official rules, write the report."""
    from keye.eval import mmmu

    items = mmmu.load_mmmu(args.split, data_dir=args.data, subjects=args.subjects)
    records = _infer(
        args,
        items,
        lambda it: mmmu.build_conversation(it, style=args.prompt_style, image_mode=args.image_mode),
        mmmu.record_for,
        engine,
    )
    if records is None:
        return 0
    overall, tables, printable, per_item = _score_mmmu_records(records, args.seed)
    config = _run_config(
        args, prompt_style=args.prompt_style, image_mode=args.image_mode, subjects=args.subjects
    )
    section = _mode_section("mmmu", records, per_item, args, args.mode)
    _finish(Path(args.out), "mmmu", args.model, config, overall, tables, printable, per_item, section)
    return 0


def cmd_mathvista(args: argparse.Namespace, engine: Any = None) -> int:
    """``keye eval mathvista``: load MathVista, answer, extract, score with the official rules, report."""
    from keye.eval import mathvista

    problems = mathvista.load_mathvista(args.split, data_dir=args.data)
    for p in problems:
        p.setdefault("id", p["pid"])
    records = _infer(args, problems, mathvista.build_conversation, mathvista.record_for, engine)
    if records is None:
        return 0
    overall, tables, scores, per_item = _score_mathvista_records(records, args, reextract=False)
    config = _run_config(
        args,
        extractor="judge" if args.judge_url else "rules",
        judge_model=args.judge_model if args.judge_url else None,
    )
    section = _mode_section("mathvista", records, per_item, args, args.mode)
    _finish(Path(args.out), "mathvista", args.model, config, overall, tables, scores, per_item, section)
    return 0


def cmd_videoqa(args: argparse.Namespace, engine: Any = None) -> int:
    """``keye eval videoqa``: answer Video-MME-style questions over local videos and score them."""
    from keye.eval import videoqa

    items = videoqa.load_items(args.data)
    video_options = {k: v for k, v in (("fps", args.fps), ("max_frames", args.max_frames)) if v is not None}
    records = _infer(
        args,
        items,
        lambda it: videoqa.build_conversation(it, use_subtitles=args.subtitles, video_options=video_options),
        videoqa.record_for,
        engine,
    )
    if records is None:
        return 0
    overall, tables, result, per_item = _score_videoqa_records(records)
    config = _run_config(args, subtitles=args.subtitles, **video_options)
    section = _mode_section("videoqa", records, per_item, args, args.mode)
    _finish(Path(args.out), "videoqa", args.model, config, overall, tables, result, per_item, section)
    return 0


def cmd_synth(args: argparse.Namespace, engine: Any = None) -> int:
    """``keye eval synth``: answer the synthetic video-QA set and report accuracy per question type."""
    from keye.eval import synth

    items = synth.load_items(args.data)
    blank = bool(getattr(args, "blank", False))  # absent when called with another command's arguments
    if blank:
        if args.limit:
            items = items[: args.limit]
        items = synth.blank_items(items, Path(args.out) / "blank_media")
    records = _infer(args, items, synth.build_conversation, synth.record_for, engine)
    if records is None:
        return 0
    overall, tables, result, per_item = _score_synth_records(records)
    section = _mode_section("synth", records, per_item, args, args.mode)
    config = _run_config(args, blank=blank)
    _finish(Path(args.out), "synth", args.model, config, overall, tables, result, per_item, section)
    return 0


def _read_any(path: Path) -> Any:
    """Return a ``.json`` file's value, or the records of a JSONL file."""
    from keye.eval.runner import read_records

    if not path.is_file():
        raise KeyeInputError("predictions file not found", path=path)
    if path.suffix == ".jsonl":
        return read_records(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KeyeInputError(f"cannot read JSON ({err})", path=path) from err


RESCORED = "unknown (re-scored)"  # a predictions file does not record the --mode it was made with


def cmd_score(args: argparse.Namespace) -> int:
    """``keye eval score BENCHMARK FILE``: re-score stored predictions and print (and optionally write) them."""
    path = Path(args.predictions)
    data = _read_any(path)
    out = Path(args.out) if args.out else None
    model_id = args.model_id or path.stem
    config = {"rescored_from": str(path)}
    if getattr(args, "difficulty_from", None):
        config["difficulty_from"] = args.difficulty_from
    section = None
    if args.benchmark == "mmmu":
        from keye.eval import mmmu
        from keye.eval.report import mmmu_report

        if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()):
            if not args.answers:
                raise KeyeInputError("an id -> prediction JSON needs the answer key (--answers)", path=path)
            answers = _read_any(Path(args.answers))
            if not isinstance(answers, dict):
                raise KeyeInputError("the answer key must be a JSON object", path=args.answers)
            printable, judged = mmmu.score_eval_only(data, answers)
            overall, tables = mmmu_report(printable, judged)
            per_item: Any = {k: {"correct": v} for k, v in judged.items()}
            config["procedure"] = "evaluation only"
        else:
            records = _as_records(data, path)
            overall, tables, printable, per_item = _score_mmmu_records(records, args.seed)
            config["procedure"] = "parse and evaluation"
            section = _mode_section("mmmu", records, per_item, args, RESCORED)
        _finish(out, "mmmu", model_id, config, overall, tables, printable, per_item, section)
        return 0
    if args.benchmark == "mathvista":
        records = list(data.values()) if isinstance(data, dict) else _as_records(data, path)
        overall, tables, scores, per_item = _score_mathvista_records(records, args, reextract=args.reextract)
        section = _mode_section("mathvista", records, per_item, args, RESCORED)
        _finish(out, "mathvista", model_id, config, overall, tables, scores, per_item, section)
        return 0
    records = _as_records(data, path)
    scorer = _score_videoqa_records if args.benchmark == "videoqa" else _score_synth_records
    overall, tables, result, per_item = scorer(records)
    section = _mode_section(args.benchmark, records, per_item, args, RESCORED)
    _finish(out, args.benchmark, model_id, config, overall, tables, result, per_item, section)
    return 0


def _as_records(data: Any, path: Path) -> list[dict[str, Any]]:
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise KeyeInputError("expected a list of prediction records (JSONL or a JSON list)", path=path)
    return data


def _rows_for_compare(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Scored rows of one side of ``keye eval compare``: a file whose records carry ``correct`` verdicts is
    used as it is; predictions are scored with ``--benchmark``'s scorer first."""
    from keye.eval import modes
    from keye.eval.runner import read_records

    records = read_records(path)
    if not records:
        raise KeyeInputError("no records", path=path)
    if all("correct" in r or "true_false" in r for r in records):
        verdicts = modes.correct_map({str(r["id"]): r for r in records})
        return [{**r, "correct": verdicts[str(r["id"])]} for r in records]
    return modes.scored_rows(
        records, _verdicts(args.benchmark, records, args), group_key=None, tokenizer=_tokenizer(args)
    )


def cmd_compare(args: argparse.Namespace) -> int:
    """``keye eval compare A B``: paired accuracy difference (A - B) with its standard error and the token
    ratio A/B over the questions both runs answered (:func:`keye.eval.modes.paired_diff`)."""
    from keye.eval import modes
    from keye.eval.report import markdown_table

    a_path, b_path = Path(args.a), Path(args.b)
    result = modes.paired_diff(_rows_for_compare(a_path, args), _rows_for_compare(b_path, args))

    def _name(p: Path) -> str:
        return f"{p.parent.name}/{p.name}" if p.parent.name else p.name

    print(markdown_table(modes.paired_table(result, _name(a_path), _name(b_path))))
    if result["unpaired_a"] or result["unpaired_b"]:
        print(
            f"unpaired questions left out: {result['unpaired_a']} only in A, "
            f"{result['unpaired_b']} only in B"
        )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps({"a": str(a_path), "b": str(b_path), **result}, indent=2) + "\n", encoding="utf-8"
        )
    return 0
