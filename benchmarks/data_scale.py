"""Per-rank memory and time to the first batch of the training loader on a 1,000,000-row set, read from the JSONL
manifest vs from its index (``keye data index``), 2 data-parallel ranks.

The set is made here: a few real clips (PyAV) and a picture reused by every row, the tiny offline processor, one
JSONL manifest of ``--rows`` rows, then its index (built in ``--workers`` processes; the time is printed). Each
side runs as 2 fresh rank processes (gloo process group, as torchrun would start them) that build the loader
and take the first micro-batch; each reports its peak resident memory (whole process: imports included) and the
seconds from the call to ``build_dataloader`` to the first batch. The JSONL side parses the whole manifest and
estimates every sample's cost on every rank (split between the ranks, then exchanged); the index side reads the
stored cost columns and materialises only its own samples. ``keye data check`` on the index is measured too
(a fresh process, peak memory).

The JSONL side at 1,000,000 rows needs several GiB per rank and many minutes: ``--jsonl-rows`` measures it on
a prefix of the manifest instead (its figures then understate what 1,000,000 rows would cost it, so the ratio
is a lower bound; the lines say which size each side ran at).

Last line: ``data loader at N rows, per-rank memory JSONL vs index: X.XXx less, first batch Y.YYx sooner``
(worst rank of each side).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_QUESTIONS = (
    "What colour is the circle in this clip?",
    "In which direction does the square move? Answer with one word.",
    "How many objects appear in the video?",
    "At what time (in seconds) do the two shapes touch? Answer with a number.",
)


def make_set(out: Path, rows: int, clips: int) -> tuple[Path, Path]:
    """Write ``clips`` real clips, a picture, the tiny processor and a ``rows``-row manifest; return
    (manifest, processor dir)."""
    from PIL import Image

    from keye.testing.processor import make_test_video, make_tiny_processor_dir

    media = out / "media"
    media.mkdir(parents=True, exist_ok=True)
    for k in range(clips):
        make_test_video(media / f"clip{k}.mp4", n_frames=12 + 6 * k, fps=6.0, size=(56 + 28 * (k % 2), 84))
    Image.new("RGB", (112, 84), (200, 60, 30)).save(media / "picture.png")
    proc = make_tiny_processor_dir(out / "processor", "preview")
    manifest = out / "train.jsonl"
    with open(manifest, "w", encoding="utf-8") as f:
        for i in range(rows):
            q = _QUESTIONS[i % len(_QUESTIONS)]
            if i % 10 == 9:
                item = '{"type":"image","image":"media/picture.png"}'
            else:
                item = f'{{"type":"video","video":"media/clip{i % clips}.mp4"}}'
            f.write(f'{{"id":"s{i:08d}","messages":[{{"role":"user","content":[{item},{{"type":"text","text":'
                    f'"{q} (sample {i})"}}]}},{{"role":"assistant","content":[{{"type":"text","text":'
                    f'"answer {i % 97}"}}]}}],"answer":"answer {i % 97}","question_type":"bench"}}\n')
    return manifest, proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(source: str, proc_dir: str, cache: str, out: str) -> None:
    """One rank (RANK / WORLD_SIZE / MASTER_* in the environment): build the loader, take the first batch, write
    {peak_mib, first_batch_s, samples} to ``out``."""
    import torch.distributed as dist
    from _memory import PeakRSS

    from keye.data.loader import build_dataloader
    from keye.data.probe import ProbeCache
    from keye.processing.processor import KeyeProcessor

    dist.init_process_group("gloo")
    try:
        proc = KeyeProcessor.from_pretrained(proc_dir)
        # What both sides import on first use (the cost model, the index reader, the decoders), imported before
        # the measurement: the figure is the loader's data, not modules.
        import av  # noqa: F401
        import pyarrow as pa

        import keye.data.cost  # noqa: F401
        import keye.data.index  # noqa: F401
        import keye.processing.video  # noqa: F401

        pa.array([0]).to_numpy()  # pyarrow loads its numpy bridge (~50 MiB) on first use
        proc([[{"role": "user", "content": "warm up"}]], return_tensors="pt", for_training=True)
        with PeakRSS(interval=0.01) as mem:
            t0 = time.perf_counter()
            dl = build_dataloader(source, proc, batch_tokens=4096, micro_batches=2, num_workers=0, seed=0,
                                  probe_cache=ProbeCache(cache), max_bad_fraction=0.0)
            batch = next(iter(dl))
            dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(out).write_text(json.dumps({"process_mib": peak, "loader_mib": mem.extra_mib, "first_batch_s": dt,
                                         "samples": len(dl.table), "batch_samples": batch["num_samples"]}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def start_side(source: Path, proc: Path, cache: Path, tmp: Path, name: str, world: int = 2) -> list:
    """Start ``world`` fresh rank processes on ``source``; :func:`finish_side` collects their reports."""
    port = _free_port()
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        out = tmp / f"{name}-rank{r}.json"
        cmd = [sys.executable, __file__, "--rank-worker", str(source), str(proc), str(cache), str(out)]
        procs.append((subprocess.Popen(cmd, env=env), out))
    return procs


def finish_side(procs: list, name: str) -> list[dict]:
    """Wait for a side's ranks and return their reports."""
    reports = []
    for p, out in procs:
        if p.wait() != 0:
            raise SystemExit(f"{name} rank exited with {p.returncode}")
        reports.append(json.loads(out.read_text()))
    return reports


def start_check(index: Path, cache: Path, proc: Path) -> subprocess.Popen:
    """``keye data check INDEX --processor PROC`` in a fresh process (its peak memory and time:
    :func:`finish_check`)."""
    code = ("import json, resource, sys, time\n"
            "from keye.data.check import check_source\nfrom keye.data.probe import ProbeCache\n"
            "from keye.processing.processor import KeyeProcessor\n"
            "t = time.perf_counter()\n"
            "rep = check_source(sys.argv[1], processor=KeyeProcessor.from_pretrained(sys.argv[3]), "
            "cache=ProbeCache(sys.argv[2]))\n"
            "print(json.dumps({'s': time.perf_counter() - t, 'valid': rep.summary['valid'], "
            "'peak_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n")
    return subprocess.Popen([sys.executable, "-c", code, str(index), str(cache), str(proc)],
                            stdout=subprocess.PIPE, text=True)


def finish_check(p: subprocess.Popen) -> dict:
    """The check process's report."""
    out, _ = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"keye data check exited with {p.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (see the module docstring); the last printed line is the ratio."""
    from _quick import parse_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of the set (the index side)")
    ap.add_argument("--jsonl-rows", type=int, default=None,
                    help="rows the JSONL side reads (default: all; fewer: a prefix, the ratio is then a lower bound)")
    ap.add_argument("--clips", type=int, default=3, help="real clips reused by the rows")
    ap.add_argument("--workers", type=int, default=None, help="index-building processes (default: all CPUs)")
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed afterwards)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --dir: keep the set and index a previous run left there (the index is then only "
                         "checked for new shards)")
    args = parse_args(ap, argv, {"rows": 2000})
    from keye.data.index import build_index

    with tempfile.TemporaryDirectory(prefix="keye-data-scale-") as tmpdir:
        tmp = Path(args.dir) if args.dir else Path(tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        manifest, proc = tmp / "train.jsonl", tmp / "processor"
        if not (args.reuse and manifest.is_file() and proc.is_dir()):
            manifest, proc = make_set(tmp, args.rows, args.clips)
            print(f"made {args.rows:,} rows over {args.clips} clips + 1 picture in {time.perf_counter() - t:.1f} s")
        cache = tmp / "probe.sqlite"
        t = time.perf_counter()
        rep = build_index([manifest], tmp / "index", processor=proc, workers=args.workers, cache=cache,
                          progress=sys.stderr.isatty())
        dt = time.perf_counter() - t
        assert rep.samples == args.rows and rep.bad == 0, rep.format()
        if rep.indexed:
            print(f"keye data index: {rep.samples:,} rows in {dt:.1f} s ({rep.samples / dt:,.0f} rows/s)")
        else:
            print(f"keye data index: {rep.samples:,} rows already indexed ({rep.skipped} unchanged shard skipped)")
        jsonl_rows = min(args.jsonl_rows or args.rows, args.rows)
        jsonl = manifest
        if jsonl_rows < args.rows:
            jsonl = tmp / "prefix.jsonl"
            with open(manifest, "rb") as src, open(jsonl, "wb") as dst:
                for _ in range(jsonl_rows):
                    dst.write(src.readline())
        # Quick runs start everything at once (their figures are not for quoting); full runs one at a time.
        chk_proc = start_check(tmp / "index", cache, proc)
        if not args.quick:
            chk = finish_check(chk_proc)
        sides, started = {}, {}
        for name, source in (("index", tmp / "index"), ("JSONL", jsonl)):
            started[name] = start_side(source, proc, cache, tmp, name)
            if not args.quick:
                sides[name] = finish_side(started[name], name)
        if args.quick:
            chk = finish_check(chk_proc)
            sides = {name: finish_side(p, name) for name, p in started.items()}
        assert chk["valid"] == args.rows
        print(f"keye data check on the {args.rows:,}-row index: peak {chk['peak_mib']:.0f} MiB, {chk['s']:.1f} s")
        for name, n in (("index", args.rows), ("JSONL", jsonl_rows)):
            reports = sides[name]
            assert all(r["samples"] == n for r in reports)
            print(f"{name} at {n:,} rows, 2 ranks: the loader's peak memory per rank "
                  f"{max(r['loader_mib'] for r in reports):.0f} MiB (whole process, imports included: "
                  f"{max(r['process_mib'] for r in reports):.0f} MiB), first batch after "
                  f"{max(r['first_batch_s'] for r in reports):.1f} s")
        if jsonl_rows < args.rows:
            print(f"(the JSONL side read a {jsonl_rows:,}-row prefix: its memory and time at {args.rows:,} rows "
                  f"would be larger, so the ratios below are lower bounds)")
        def worst(name: str, key: str) -> float:
            return max(r[key] for r in sides[name])

        mem_ratio = worst("JSONL", "loader_mib") / max(worst("index", "loader_mib"), 1.0)
        time_ratio = worst("JSONL", "first_batch_s") / worst("index", "first_batch_s")
        print(f"data loader at {args.rows} rows, per-rank memory JSONL vs index: {mem_ratio:.2f}x less, "
              f"first batch {time_ratio:.2f}x sooner")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-worker":
        rank_main(*sys.argv[2:6])
    else:
        main()
