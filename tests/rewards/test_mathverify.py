"""math-verify behind a hard time limit: timeouts, restarts, threads, forked children and the cache."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from keye.rewards import MathVerifier, RewardSpec, score, score_batch

HUGE = "9^{9^{9^{9^{9}}}}"  # SymPy tries to evaluate this exactly: it never finishes on its own


@pytest.fixture()
def verifier():
    v = MathVerifier(timeout_s=0.5, cache_size=16)
    yield v
    v.close()


def test_equivalences(verifier) -> None:
    assert verifier.equivalent("\\frac{1}{2}", "0.5")
    assert verifier.equivalent("2\\sqrt{2}", "\\sqrt{8}")
    assert not verifier.equivalent("\\frac{1}{2}", "\\frac{1}{3}")
    assert verifier.last_status == "ok"


def test_timeout_kills_and_restarts_the_worker(verifier) -> None:
    # Start the worker first: its start-up (importing SymPy, seconds on a loaded machine) is outside the
    # limit by design, and only the comparison is timed here.
    assert verifier.equivalent("3", "1+2") and verifier.stats["restarts"] == 0
    t0 = time.perf_counter()
    assert verifier.equivalent("1", HUGE) is False
    assert time.perf_counter() - t0 < 0.5 + 2.0  # hard limit plus process kill
    assert verifier.last_status == "timeout" and verifier.stats["timeouts"] == 1
    assert verifier.equivalent("2", "1+1")  # a fresh worker answers the next call
    assert verifier.stats["restarts"] == 1
    # The timed-out pair is cached as "no" so it does not cost another restart.
    t0 = time.perf_counter()
    assert verifier.equivalent("1", HUGE) is False
    assert verifier.last_status == "cached" and time.perf_counter() - t0 < 0.1


def test_cache_hits_and_lru_bound(verifier) -> None:
    verifier.equivalent("\\pi", "3.14159265358979")
    verifier.equivalent("\\pi", "3.14159265358979")
    assert verifier.stats["cache_hits"] == 1 and verifier.last_status == "cached"
    for i in range(40):
        verifier.equivalent(str(i), str(i + 1))
    assert len(verifier._cache) == 16


def test_works_off_the_main_thread() -> None:
    # math-verify's own signal timeout raises ValueError off the main thread; ours must not.
    results: list = []
    spec = RewardSpec(math_timeout_s=2.0)

    def run() -> None:
        batch = score_batch(["\\boxed{0.5}", "\\boxed{\\frac{2}{4}}", "\\boxed{3}"], ["\\frac{1}{2}"] * 3,
                            tasks="math", spec=spec)
        results.extend(r.parts["accuracy"] for r in batch)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [1.0, 1.0, 0.0] * 3


def test_inline_backend_main_thread_and_fallback() -> None:
    spec = RewardSpec(math_backend="inline", math_timeout_s=1.0)
    assert score("\\boxed{\\sqrt{8}}", reference="2\\sqrt{2}", task="math", spec=spec).parts["accuracy"] == 1.0
    out: list = []
    t = threading.Thread(target=lambda: out.append(
        score("\\boxed{\\sqrt{8}}", reference="2\\sqrt{2}", task="math", spec=spec).parts["accuracy"]))
    t.start()
    t.join(timeout=60)
    assert out == [1.0]


def _child(queue) -> None:
    r = score("\\boxed{\\sqrt{8}}", reference="2\\sqrt{2}", task="math", spec=RewardSpec(math_timeout_s=2.0))
    queue.put(r.parts["accuracy"])


def test_forked_child_gets_its_own_worker() -> None:
    # Warm the parent's worker first so the child inherits its pipes, then score in the child.
    score("\\boxed{\\sqrt{18}}", reference="3\\sqrt{2}", task="math", spec=RewardSpec(math_timeout_s=2.0))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    value = queue.get(timeout=60)
    proc.join(timeout=60)
    assert value == 1.0 and proc.exitcode == 0
    # The parent's worker still answers.
    assert score("\\boxed{0.5}", reference="\\frac{1}{2}", task="math",
                 spec=RewardSpec(math_timeout_s=2.0)).parts["accuracy"] == 1.0


def test_timeout_reported_in_info_and_stats() -> None:
    from keye.rewards import aggregate_stats

    spec = RewardSpec(math_timeout_s=0.5, math_cache_size=0)
    results = score_batch([f"\\boxed{{{HUGE}}}", "\\boxed{1}"], ["1", "1"], tasks="math", spec=spec)
    assert results[0].info["accuracy"] == "timeout" and results[0].parts["accuracy"] == 0.0
    assert results[1].parts["accuracy"] == 1.0
    assert aggregate_stats(results)["reward/math_timeouts"] == 1.0


def test_high_file_descriptors() -> None:
    # Trainer processes often hold > 1024 descriptors; select() cannot wait on those, poll() can.
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1300
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    null = os.open(os.devnull, os.O_RDONLY)
    held = []
    try:
        while len(held) < 1100:
            held.append(os.dup(null))
        v = MathVerifier(timeout_s=2.0, cache_size=0)
        try:
            assert v._worker is None
            assert v.equivalent("\\frac{1}{2}", "0.5")
            assert v._worker is not None and v._worker.proc.stdout.fileno() > 1024
        finally:
            v.close()
    finally:
        for fd in held:
            os.close(fd)
        os.close(null)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_missing_math_verify_is_a_config_error(monkeypatch) -> None:
    import importlib.util

    from keye.errors import KeyeConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(KeyeConfigError, match="math-verify"):
        MathVerifier()
