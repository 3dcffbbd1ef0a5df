"""``keye eval``: run a benchmark on a model, or re-score stored predictions.

::

    keye eval mmmu      --model PATH --split validation --mode think --out runs/mmmu
    keye eval mathvista --model PATH --split testmini --out runs/mathvista [--judge-url URL]
    keye eval videoqa   --model PATH --data videomme.jsonl --out runs/videomme
    keye eval synth     --model PATH --data data/synth/test.jsonl --out runs/synth
    keye eval score mathvista runs/mathvista/predictions.jsonl
    keye eval score mmmu total_val_output.json --answers answer_dict_val.json

A run writes ``<out>/predictions.jsonl`` (resumable), ``<out>/scores.json`` (the benchmark's own output),
``<out>/judgements.jsonl`` (per-item parse and verdict) and ``<out>/report.{json,md}``. Launch with
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

from keye.errors import KeyeInputError

BENCHMARKS = ("mmmu", "mathvista", "videoqa", "synth")


# ------------------------------------------------------------------------------------------- parsers


def _add_model_args(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or hub id")
    p.add_argument("--out", default=default_out, help="run directory (predictions, scores, report)")
    p.add_argument(
        "--mode", choices=("think", "no_think", "auto"), default=None, help="Keye thinking mode switch"
    )
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument(
        "--sampling",
        choices=("greedy", "keye"),
        default="greedy",
        help="greedy (official) or Keye's sampling",
    )
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    p.add_argument("--no-progress", action="store_true")


def _add_judge_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--judge-url", default=None, help="OpenAI-compatible endpoint for the official LLM extraction"
    )
    p.add_argument("--judge-model", default="gpt-4o-mini")
    p.add_argument(
        "--judge-api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key"
    )
    p.add_argument("--quick-extract", action="store_true", help='official `The answer is "..."` shortcut')
    p.add_argument("--ignore-empty-extractions", action="store_true")


def add_commands(subparsers: Any) -> None:
    """Add ``keye eval {mmmu,mathvista,videoqa,synth,score}`` to the ``keye`` command line."""
    ev = subparsers.add_parser("eval", help="evaluate a model on a benchmark, or re-score predictions")
    sub = ev.add_subparsers(dest="eval_command", metavar="BENCHMARK")
    ev.set_defaults(func=lambda args: (ev.print_help(), 2)[1])

    p = sub.add_parser("mmmu", help="MMMU (official prompts, parsing and aggregation)")
    _add_model_args(p, "runs/mmmu")
    p.add_argument("--split", default="validation", choices=("dev", "validation", "test"))
    p.add_argument("--data", default=None, help="local copy: directory of parquet files")
    p.add_argument("--subjects", nargs="*", default=None)
    p.add_argument("--prompt-style", choices=("mmmu", "vlmevalkit"), default="mmmu")
    p.add_argument("--image-mode", choices=("interleave", "first"), default="interleave")
    p.add_argument("--seed", type=int, default=42, help="seed of the official random fallback")
    p.set_defaults(func=cmd_mmmu)

    p = sub.add_parser("mathvista", help="MathVista (official query, extraction and scoring)")
    _add_model_args(p, "runs/mathvista")
    p.add_argument("--split", default="testmini", choices=("testmini", "test"))
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
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("score", help="re-score stored predictions (ours or the official JSON formats)")
    p.add_argument("benchmark", choices=BENCHMARKS)
    p.add_argument("predictions", help="predictions.jsonl, or an official output JSON")
    p.add_argument("--answers", default=None, help="MMMU answer key for an id->prediction JSON (eval only)")
    p.add_argument("--out", default=None, help="write scores and report here")
    p.add_argument("--model-id", default=None, help="model name for the report")
    p.add_argument("--reextract", action="store_true", help="MathVista: extract again even if stored")
    p.add_argument("--seed", type=int, default=42)
    _add_judge_args(p)
    p.set_defaults(func=cmd_score)


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

    rank, world = init_distributed()
    if args.limit is not None:
        items = items[: args.limit]
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


def _finish(
    out: Path | None,
    benchmark: str,
    model_id: str | None,
    config: Mapping[str, Any],
    overall: dict[str, Any],
    tables: Mapping[str, list[dict[str, Any]]],
    official: Any,
    per_item: Mapping[str, Any] | None,
) -> None:
    from keye.eval.report import markdown_table, write_report

    print(markdown_table([overall]))
    if out is None:
        for title, rows in tables.items():
            print(f"\n{title}\n{markdown_table(rows)}")
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "scores.json").write_text(
        json.dumps(official, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if per_item is not None:
        _write_judgements(out, per_item)
    paths = write_report(
        out,
        benchmark=benchmark,
        model_id=model_id,
        config=config,
        overall=overall,
        tables=tables,
        official=official,
    )
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
    _finish(Path(args.out), "mmmu", args.model, config, overall, tables, printable, per_item)
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
    _finish(Path(args.out), "mathvista", args.model, config, overall, tables, scores, per_item)
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
    _finish(Path(args.out), "videoqa", args.model, config, overall, tables, result, per_item)
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
    _finish(Path(args.out), "synth", args.model, _run_config(args, blank=blank), overall, tables, result, per_item)
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


def cmd_score(args: argparse.Namespace) -> int:
    """``keye eval score BENCHMARK FILE``: re-score stored predictions and print (and optionally write) them."""
    path = Path(args.predictions)
    data = _read_any(path)
    out = Path(args.out) if args.out else None
    model_id = args.model_id or path.stem
    config = {"rescored_from": str(path)}
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
        _finish(out, "mmmu", model_id, config, overall, tables, printable, per_item)
        return 0
    if args.benchmark == "mathvista":
        records = list(data.values()) if isinstance(data, dict) else _as_records(data, path)
        overall, tables, scores, per_item = _score_mathvista_records(records, args, reextract=args.reextract)
        _finish(out, "mathvista", model_id, config, overall, tables, scores, per_item)
        return 0
    records = _as_records(data, path)
    scorer = _score_videoqa_records if args.benchmark == "videoqa" else _score_synth_records
    overall, tables, result, per_item = scorer(records)
    _finish(out, args.benchmark, model_id, config, overall, tables, result, per_item)
    return 0


def _as_records(data: Any, path: Path) -> list[dict[str, Any]]:
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise KeyeInputError("expected a list of prediction records (JSONL or a JSON list)", path=path)
    return data
