"""``keye serve`` throughput: 8 concurrent clients, batched engine vs one request at a time (keye-tiny, CPU).

Starts the server in this process on a loopback port twice: once with ``max_batch_size=8`` (requests that
arrive within the collection window decode together as one left-padded batch) and once with
``max_batch_size=1`` (the sequential baseline). Each run sends the same requests from 8 client threads with
the real ``openai`` client: a short video clip and a question, greedy, ``max_tokens`` fixed, and counts
completed requests per second. Runs alternate, the median of ``--repeats`` is reported; the last line is
the batched / sequential ratio. Last line: ``serve throughput batched vs sequential: X.XXx``
Usage: python benchmarks/serve.py [--requests 32] [--repeats 3] [--max-tokens 16] [--quick]
       (``--quick``: one repeat of 8 requests of up to 4 tokens)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from openai import OpenAI

import keye
from keye.serve.app import BackgroundServer, KeyeServer, ServerConfig
from keye.serve.engine import EngineConfig
from keye.serve.media import MediaPolicy
from keye.testing.processor import make_test_video


def run(model, proc, clip: Path, batch: int, requests: int, max_tokens: int, clients: int = 8) -> tuple[float, dict]:
    """Requests/s of ``requests`` chat completions from ``clients`` threads against a fresh server."""
    cfg = ServerConfig(engine=EngineConfig(max_batch_size=batch, batch_window_ms=10, max_queue=256),
                       media=MediaPolicy(allowed_dirs=[clip.parent]))
    with BackgroundServer(KeyeServer(model, proc, cfg)) as bg:
        client = OpenAI(base_url=bg.url, api_key="unused", max_retries=0, timeout=600)

        def ask(i: int):
            return client.chat.completions.create(
                model="keye-tiny", max_tokens=max_tokens, temperature=0,
                messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": str(clip)}},
                    {"type": "text", "text": f"Question {i}: how many shapes appear?"}]}])

        ask(-1)  # warm-up: first-call allocations and thread start-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            done = list(pool.map(ask, range(requests)))
        dt = time.perf_counter() - t0
        assert len(done) == requests and all(r.choices for r in done)
        return requests / dt, dict(bg.server.engine.stats)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``) and print medians; the last
    line is the batched-vs-sequential ratio."""
    from _quick import parse_args, torch_threads

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = parse_args(ap, argv, {"requests": 8, "repeats": 1, "max_tokens": 4})
    torch.set_num_threads(torch_threads(args))
    model, proc = keye.load_tiny()
    with tempfile.TemporaryDirectory() as tmp:
        clip = make_test_video(Path(tmp) / "clip.mp4", 40, fps=10, size=(96, 128)).path
        rates: dict[str, list[float]] = {"sequential": [], "batched": []}
        for _ in range(args.repeats):
            for name, size in (("sequential", 1), ("batched", 8)):
                rate, stats = run(model, proc, clip, size, args.requests, args.max_tokens)
                rates[name].append(rate)
                print(f"{name:>10}: {rate:6.2f} requests/s  ({stats['batches'] - 1} batches for "
                      f"{stats['requests'] - 1} requests, {stats['generated_tokens']} tokens)", flush=True)
    seq, bat = statistics.median(rates["sequential"]), statistics.median(rates["batched"])
    print(f"median requests/s with 8 concurrent clients: sequential {seq:.2f}, batched {bat:.2f}")
    print(f"serve throughput batched vs sequential: {bat / seq:.2f}x")


if __name__ == "__main__":
    main()
