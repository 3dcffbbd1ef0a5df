"""``keye data``: validate manifests, make the synthetic video-QA set, CLIP-filter image-text pairs.

::

    keye data check MANIFEST|INDEX [--root DIR] [--processor DIR] [--json]
    keye data index SOURCES... --out DIR [--processor DIR] [--mode MODE] [--workers N] [--root DIR]
    keye data synth --out data/synth --train 20000 --test 1000 --seed 0 [--workers N] [--image-fraction 0.1]
                    [--warmup N] [--modes [--auto-labels type|mixed]] [--places]
    keye data clip-filter MANIFEST --out KEPT.jsonl --checkpoint CLIP.pt --model ViT-B-32 --threshold 0.3
    keye data autothink MANIFEST --out DIR --base-url http://127.0.0.1:8000/v1 --model keye-tiny
                        [--solver-url/--solver-model/... per role] [--concurrency 4] [--rps 0] [--retries 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

# keye.data.synth.EXTRA_VIDEO_TYPES, spelt out so that --help need not import the generator (and numpy);
# tests/test_cli.py checks the two agree.
OPT_IN_TYPES = ("price_sum", "when_gap", "when_sum")


def add_commands(subparsers: Any) -> None:
    """Add ``keye data {check,index,synth,clip-filter,autothink}`` to the top-level ``keye`` parser."""
    data = subparsers.add_parser(
        "data", help="training data: check manifests, index large sets, synthetic set, CLIP filter, AutoThink labels")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.set_defaults(func=lambda a: (data.print_help(), 2)[1])

    p = sub.add_parser("check", help="list every bad row of a manifest or index and summarise it (exit 1 if any is "
                       "bad); streams, so memory stays bounded at any size")
    p.add_argument("manifest", help="JSONL manifest, or an index folder made by 'keye data index'")
    p.add_argument("--root", default=None, help="directory media paths are relative to (default: manifest dir)")
    p.add_argument("--processor", default=None, help="processor/checkpoint dir for exact token counts")
    p.add_argument("--cache", default=None, help="probe cache file (default ~/.cache/keye/probe.sqlite)")
    p.add_argument("--max-rows", type=int, default=50, help="bad rows to print")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--workers", type=int, default=None,
                   help="processes probing a JSONL manifest's rows (default: all CPUs; 0 = in-process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_check)

    p = sub.add_parser("index", help="index a training set of any size (JSONL files or shards, Parquet, WebDataset "
                       "tars, saved datasets, fsspec URLs) into a memory-mapped folder the loader reads lazily")
    p.add_argument("sources", nargs="+", help="files, folders, globs, saved datasets folders or fsspec URLs")
    p.add_argument("--out", required=True, help="index folder (created; an existing index there gains new shards)")
    p.add_argument("--processor", default=None,
                   help="processor/checkpoint dir the training run uses, so the stored costs are the loader's "
                        "(default: the approximate stand-in of 'keye data check'; the loader then re-estimates)")
    p.add_argument("--mode", default=None, help="thinking mode the run's processor renders with (data.processor_kwargs)")
    p.add_argument("--root", default=None, help="directory media paths are relative to (default: each shard's dir)")
    p.add_argument("--workers", type=int, default=None, help="processes probing rows (default: all CPUs; 0 = in-process)")
    p.add_argument("--cache", default=None, help="probe cache file (default ~/.cache/keye/probe.sqlite)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_index)

    p = sub.add_parser("synth", help="generate the synthetic video-QA set")
    p.add_argument("--out", required=True, help="output folder (train.jsonl, test.jsonl and the media)")
    p.add_argument("--train", type=int, required=True, help="samples in the train split")
    p.add_argument("--test", type=int, required=True, help="samples in the test split")
    p.add_argument("--seed", type=int, default=0, help="seed of the whole set (a sample depends on it and its index)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs; 0 = in-process)")
    p.add_argument("--image-fraction", type=float, default=0.1, help="share of image-only samples")
    p.add_argument("--warmup", type=int, default=0,
                   help="also write N large-object caption images (warmup.jsonl, keye-tiny's perception stage)")
    p.add_argument("--modes", action="store_true",
                   help="add thinking-mode targets (think / no_think / auto) and write <split>_modes.jsonl")
    p.add_argument("--auto-labels", choices=("type", "mixed"), default="type",
                   help="with --modes, the auto rows' decisions: type (think on the stepwise question types "
                        "only) or mixed (each sample 50/50)")
    p.add_argument("--extra-type", action="append", default=[], metavar="TYPE=WEIGHT",
                   help="also draw an opt-in video question type with this weight (the defaults weigh 0.7-1), "
                        "e.g. when_gap=3; repeatable (opt-in types: " + ", ".join(OPT_IN_TYPES) + ")")
    p.add_argument("--places", action="store_true",
                   help="the captions also say where each object is (its 3 x 3 grid cell: top left ... bottom right)")
    p.add_argument("--detail-cut", action="store_true",
                   help="detail scenes: the tiny shape arrives with its distractors, so a key frame shows it")
    p.add_argument("--position-weight", type=float, default=1.0,
                   help="weight of the position type among the image types (default 1, as the others)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_synth)

    p = sub.add_parser("clip-filter", help="keep image-text pairs whose CLIP score is above a threshold")
    p.add_argument("manifest", help="JSONL manifest of image-text pairs")
    p.add_argument("--out", required=True, help="filtered manifest to write")
    p.add_argument("--model", default="ViT-B-32", help="open_clip architecture name")
    p.add_argument("--model-config", default=None, help="open_clip model config JSON (overrides --model)")
    p.add_argument("--checkpoint", required=True, help="local open_clip weights file")
    p.add_argument("--threshold", type=float, required=True, help="keep rows whose score is at least this")
    p.add_argument("--score", choices=("cosine", "clipscore"), default="cosine",
                   help="cosine similarity, or CLIPScore (2.5 x max(cosine, 0))")
    p.add_argument("--text-from", choices=("assistant", "user", "all"), default="assistant",
                   help="which turns' text is compared with the image")
    p.add_argument("--drop-non-pairs", action="store_true", help="drop rows that are not one image + text")
    p.add_argument("--root", default=None, help="directory media paths are relative to (default: manifest dir)")
    p.add_argument("--batch-size", type=int, default=64, help="pairs scored together")
    p.add_argument("--device", default="cpu", help="torch device of the CLIP model")
    p.set_defaults(func=_clip_filter)

    _add_autothink(sub)


_AUTOTHINK_HELP = """\
Three roles answer every question of MANIFEST through OpenAI-compatible chat endpoints (keye serve, vLLM,
a hosted API): the solver directly (prompt + /no_think), the thinker with a reasoning trace (prompt +
/think), and the critic checks both against the row's reference answer. The label is "no_think" when the
direct answer is right, "think" when only the reasoned one is, else "unsolved". The rule check (keye's
synthetic-set scorer, deterministic) decides by default; the LLM critic's verdict is recorded next to it
(--decide-by llm lets it decide, --no-critic-llm skips it).

Writes DIR/autothink.jsonl (a keye SFT manifest whose assistant turns are Keye's auto format:
<analysis>..</analysis> then <think>..</think>answer or the direct answer; columns mode_label, solver,
thinker, critic), DIR/dropped.jsonl (unsolved questions), DIR/failed.jsonl (this run's failures and bad
input rows) and DIR/summary.json. Rerunning the same command resumes: ids already written are skipped.

Each role takes its endpoint from --ROLE-url / --ROLE-model / --ROLE-api-key-env, falling back to
--base-url / --model / --api-key-env. API keys are read from the named environment variable only.
"""


def _add_autothink(sub: Any) -> None:
    import argparse as _argparse

    p = sub.add_parser("autothink", help="label questions with the thinking mode that suffices (solver / "
                       "thinker / critic over OpenAI-compatible endpoints) and write a mode-labelled SFT manifest",
                       description=_AUTOTHINK_HELP, formatter_class=_argparse.RawDescriptionHelpFormatter)
    p.add_argument("manifest", help="input manifest of questions with references (answer, answer_kind, ...)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created; reused to resume)")
    g = p.add_argument_group("endpoints (defaults for every role)")
    g.add_argument("--base-url", default=None, metavar="URL",
                   help="API root of the endpoint, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--model", default=None, metavar="NAME", help="model name sent in each request")
    g.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="VAR",
                   help="environment variable holding the API key (default OPENAI_API_KEY; unset = 'EMPTY')")
    g.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds per HTTP attempt (default 120)")
    defaults = {"solver": ("/no_think", 512), "thinker": ("/think", 2048), "critic": ("", 512)}
    for role, (suffix, max_tokens) in defaults.items():
        g = p.add_argument_group(f"{role} endpoint (overrides the defaults above)")
        g.add_argument(f"--{role}-url", default=None, metavar="URL", help=f"API root for the {role}")
        g.add_argument(f"--{role}-model", default=None, metavar="NAME", help=f"model name for the {role}")
        g.add_argument(f"--{role}-api-key-env", default=None, metavar="VAR",
                       help=f"API key variable for the {role}")
        g.add_argument(f"--{role}-temperature", type=float, default=0.0, metavar="T",
                       help="sampling temperature (default 0)")
        g.add_argument(f"--{role}-max-tokens", type=int, default=max_tokens, metavar="N",
                       help=f"reply budget in tokens (default {max_tokens})")
        g.add_argument(f"--{role}-suffix", default=suffix, metavar="TEXT",
                       help=f"text appended to the question (default {suffix!r}: Keye's / Qwen3's mode switch)")
    g = p.add_argument_group("critic and labels")
    g.add_argument("--no-critic-llm", action="store_true", help="rule check only: no critic requests")
    g.add_argument("--decide-by", choices=("rule", "llm"), default="rule",
                   help="which verdict sets the label (default rule; the LLM verdict is always recorded)")
    g.add_argument("--unsolved", choices=("drop", "keep"), default="drop",
                   help="unsolved questions: drop (to dropped.jsonl, default) or keep as prompt-only rows")
    g = p.add_argument_group("running")
    g.add_argument("--media", choices=("data", "path"), default="data",
                   help="send local images/videos as base64 data: URLs (default, any endpoint) or file:// URLs "
                   "(the server must be allowed to read them, e.g. keye serve --allow-local-media DIR)")
    g.add_argument("--concurrency", type=int, default=4, metavar="N",
                   help="questions in flight (threads, default 4)")
    g.add_argument("--rps", type=float, default=0.0, metavar="R",
                   help="max request starts per second, all roles (0 = no limit)")
    g.add_argument("--retries", type=int, default=5, metavar="K",
                   help="retries per request on connection errors, timeouts, 408/409/429/5xx (default 5)")
    g.add_argument("--backoff", type=float, default=0.5, metavar="S",
                   help="first retry delay in seconds, doubled each retry")
    g.add_argument("--backoff-max", type=float, default=30.0, metavar="S",
                   help="cap on one retry delay, seconds")
    g.add_argument("--limit", type=int, default=None, metavar="N",
                   help="only the first N questions of the manifest")
    g.add_argument("--resume", action=_argparse.BooleanOptionalAction, default=True,
                   help="skip ids already in the output (default); --no-resume empties the output first")
    g.add_argument("--transport", choices=("openai", "httpx"), default=None,
                   help="HTTP client (default: the openai package when installed, else httpx)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_autothink)


def _check(args: argparse.Namespace) -> int:
    from keye.data.check import check_source
    from keye.data.probe import ProbeCache

    proc = None
    if args.processor:
        from keye.processing.processor import KeyeProcessor

        proc = KeyeProcessor.from_pretrained(args.processor)
    rep = check_source(args.manifest, args.root, processor=proc, cache=ProbeCache(args.cache), workers=args.workers,
                       progress=not args.no_progress and not args.json)
    if args.json:
        bad = [{"line": b.line, "id": b.id, "reason": b.reason} for b in rep.bad_rows]
        print(json.dumps({"bad_rows": bad, "summary": rep.summary}, indent=2))
    else:
        print(rep.format(args.max_rows))
    return 1 if rep.bad_rows else 0


def _index(args: argparse.Namespace) -> int:
    from keye.data.index import build_index

    rep = build_index(args.sources, args.out, processor=args.processor, mode=args.mode, root=args.root,
                      workers=args.workers, cache=args.cache, progress=not args.no_progress)
    print(rep.format())
    return 0


def parse_type_weights(items: list[str]) -> dict[str, float] | None:
    """``["when_gap=3", ...]`` -> ``{"when_gap": 3.0}`` (None for no items); raises ``KeyeConfigError``
    naming an item that is not ``TYPE=WEIGHT`` with a number."""
    from keye.errors import KeyeConfigError

    out = {}
    for item in items:
        name, sep, weight = item.partition("=")
        try:
            out[name.strip()] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise KeyeConfigError(f"--extra-type {item!r}: expected TYPE=WEIGHT, e.g. when_gap=3")
    return out or None


def _synth(args: argparse.Namespace) -> int:
    from keye.data.synth import generate

    t0 = time.perf_counter()
    paths = generate(
        args.out, train=args.train, test=args.test, seed=args.seed, workers=args.workers,
        image_fraction=args.image_fraction, progress=not args.no_progress, warmup=args.warmup,
        modes=args.modes, auto_labels=args.auto_labels, extra_types=parse_type_weights(args.extra_type),
        places=args.places, detail_cut=args.detail_cut, position_weight=args.position_weight,
    )
    dt = time.perf_counter() - t0
    n = args.train + args.test
    print(f"wrote {paths['train']} ({args.train}) and {paths['test']} ({args.test}) in {dt:.1f} s "
          f"({n / max(dt, 1e-9):.0f} samples/s)", file=sys.stderr)
    return 0


def _clip_filter(args: argparse.Namespace) -> int:
    from keye.data.clip_filter import ClipScorer, clip_filter_manifest

    scorer = ClipScorer.load(args.model, args.checkpoint, model_config=args.model_config, device=args.device)
    rep = clip_filter_manifest(
        args.manifest, args.out, scorer, threshold=args.threshold, root=args.root, score=args.score,
        text_from=args.text_from, drop_non_pairs=args.drop_non_pairs, batch_size=args.batch_size,
    )
    for b in rep.bad:
        print(f"bad: {b}", file=sys.stderr)
    print(rep.format())
    return 0


def _autothink(args: argparse.Namespace) -> int:
    from keye.data.autothink import AutoThinkDataConfig, EndpointConfig, synthesize
    from keye.errors import KeyeConfigError

    endpoints = {}
    for role in ("solver", "thinker", "critic"):
        url = getattr(args, f"{role}_url") or args.base_url
        model = getattr(args, f"{role}_model") or args.model
        if role == "critic" and args.no_critic_llm:
            url, model = url or "http://unused", model or "unused"
        if not url or not model:
            raise KeyeConfigError(f"the {role} has no endpoint: pass --base-url and --model, or --{role}-url and "
                                  f"--{role}-model")
        endpoints[role] = EndpointConfig(
            base_url=url, model=model, api_key_env=getattr(args, f"{role}_api_key_env") or args.api_key_env,
            temperature=getattr(args, f"{role}_temperature"), max_tokens=getattr(args, f"{role}_max_tokens"),
            suffix=getattr(args, f"{role}_suffix"), timeout=args.timeout,
        )
    config = AutoThinkDataConfig(
        **endpoints, critic_llm=not args.no_critic_llm, decide_by=args.decide_by, unsolved=args.unsolved,
        media=args.media, concurrency=args.concurrency, rps=args.rps, retries=args.retries, backoff=args.backoff,
        backoff_max=args.backoff_max, limit=args.limit, resume=args.resume, transport=args.transport,
        progress=not args.no_progress,
    )
    try:
        summary = synthesize(args.manifest, args.out, config)
    except KeyboardInterrupt:
        print(f"interrupted; what completed is in {args.out} and the same command resumes", file=sys.stderr)
        return 130
    print(summary.format())
    return 1 if summary.failed or summary.bad_input else 0
