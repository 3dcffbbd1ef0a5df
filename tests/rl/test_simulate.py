"""keye.rl.distributed.simulate: the discrete-event model of synchronous vs asynchronous RL on a cluster.

Checks: the synchronous throughput against the closed form for constant lengths; constant lengths with
free sync and no fixed costs leave nothing to overlap (async / sync = 1); long-tailed lengths make async
faster; the staleness bound holds; partial rollouts happen; results are deterministic per seed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from keye.errors import KeyeConfigError
from keye.rl.distributed.simulate import ClusterConfig, ceiling, compare, simulate

SMALL = ClusterConfig(n_gpus=8, batch_prompts=8, group_size=4, steps=6, warmup_steps=1, length_mu=4.0,
                      length_sigma=1.0, max_tokens=512, prompt_tokens=32, max_concurrent=4, decode_step_s=0.01,
                      decode_token_s=0.001, prefill_token_s=1e-5, train_token_s=2e-4, train_step_s=0.05,
                      sync_s=0.05)

# constant answers (sigma 0 -> exp(mu) tokens), costs strictly proportional to work, free weight sync
CONSTANT = replace(SMALL, length_mu=4.0, length_sigma=0.0, decode_step_s=0.0, prefill_token_s=0.0,
                   train_step_s=0.0, sync_s=0.0)


def test_lengths_are_lognormal_capped_and_seeded():
    lengths = SMALL.lengths(2000)
    assert lengths.min() >= 1 and lengths.max() == SMALL.max_tokens  # the tail reaches the cap
    import numpy as np

    assert abs(np.median(lengths) - np.exp(SMALL.length_mu)) < 5  # median of a lognormal: exp(mu)
    assert (SMALL.lengths(10) == lengths[:10]).all()  # prefix independent of how many are drawn
    assert not (replace(SMALL, seed=1).lengths(10) == lengths[:10]).all()
    assert (CONSTANT.lengths(5) == 55).all()  # exp(4) = 54.6 -> 55


def test_sync_throughput_matches_the_closed_form_for_constant_lengths():
    cfg = CONSTANT
    L, S, N, P = 55, cfg.batch_prompts * cfg.group_size, cfg.n_gpus, cfg.prompt_tokens
    per_gpu = S / N  # answers decoded together on each GPU (<= max_concurrent)
    gen = L * cfg.decode_token_s * per_gpu  # L steps of per_gpu answers
    train = S * (P + L) * cfg.train_token_s / N
    r = simulate(cfg, 0)
    assert r.samples_per_s == pytest.approx(S / (gen + train), rel=1e-9)
    assert r.step_s == pytest.approx([gen + train] * cfg.steps, rel=1e-9)
    assert r.max_staleness_seen == 0 and r.partial == 0 and r.preempted == 0


def test_constant_lengths_and_free_sync_leave_nothing_to_overlap():
    """Without a long tail, fixed per-step costs or a sync cost, every GPU is busy all the time in the
    synchronous loop too, so asynchrony cannot help: the ratio is 1."""
    sync, best = compare(CONSTANT, 1)
    assert best.samples_per_s / sync.samples_per_s == pytest.approx(1.0, abs=0.01)
    colocated = simulate(CONSTANT, 1)
    assert colocated.samples_per_s / sync.samples_per_s == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_beats_sync_with_long_tailed_lengths(seed):
    cfg = replace(SMALL, seed=seed)
    sync, best = compare(cfg, 1)
    assert best.samples_per_s > 1.1 * sync.samples_per_s
    assert simulate(cfg, 1).samples_per_s >= sync.samples_per_s
    assert best.decode_busy > sync.decode_busy  # the tail's idle GPUs did work


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_bound_holds_and_async_has_partial_rollouts(k):
    for placement, train in (("colocated", None), ("tagged", 2)):
        r = simulate(SMALL, k, placement, train)
        assert r.max_staleness_seen <= k
        if k:
            assert r.max_staleness_seen == k  # the bound is used, not just respected
            assert r.partial > 0
        elif placement == "colocated":
            assert r.partial == 0 and r.preempted == 0


def test_more_staleness_is_never_slower_here():
    rates = [simulate(SMALL, k).samples_per_s for k in (0, 1, 2)]
    assert rates == sorted(rates)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_placement_beats_the_pipeline_ceiling(seed):
    """The bound of :func:`ceiling` holds for every placement and staleness, on long tails, on memory-bound
    decoding (a step costs the same for any batch) and when training dominates."""
    flat = replace(SMALL, decode_step_s=SMALL.decode_step_s + SMALL.max_concurrent * SMALL.decode_token_s,
                   decode_token_s=0.0)
    heavy = replace(SMALL, train_token_s=2e-3)
    for name, base in (("tail", SMALL), ("flat", flat), ("heavy", heavy), ("sigma 1.5", replace(SMALL, length_sigma=1.5))):
        cfg = replace(base, seed=seed, steps=10, warmup_steps=2)
        sync = simulate(cfg, 0)
        for k in (1, 2):
            bound = ceiling(cfg, k, sync)
            assert ceiling(cfg, k) == bound  # runs the synchronous simulation itself when not given
            for placement, train in (("colocated", None), *(("tagged", t) for t in (1, 2, 4, 6, 7))):
                ratio = simulate(cfg, k, placement, train).samples_per_s / sync.samples_per_s
                assert ratio <= bound * 1.01, (name, k, placement, train, ratio, bound)  # 1 %: finite-run edges
        if name == "flat":  # a step's cost does not depend on the batch: about k + 1
            assert ceiling(cfg, 1, sync) == pytest.approx(2.0, rel=0.05)
            assert ceiling(cfg, 2, sync) == pytest.approx(3.0, rel=0.05)
    with pytest.raises(KeyeConfigError, match="max_staleness"):
        ceiling(SMALL, -1)


@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_update_keeps_the_bound_and_stays_under_its_ceiling(seed):
    """The streaming update (each group of batch v trained as soon as it is complete, the step when the batch is
    whole) keeps the staleness bound, trains every answer once per update, and no placement beats its own
    ceiling, which is at least the barrier's (the update no longer waits for the tail's training)."""
    flat = replace(SMALL, decode_step_s=SMALL.decode_step_s + SMALL.max_concurrent * SMALL.decode_token_s,
                   decode_token_s=0.0)
    for name, base in (("tail", SMALL), ("flat", flat), ("heavy", replace(SMALL, train_token_s=2e-3))):
        cfg = replace(base, seed=seed, steps=10, warmup_steps=2)
        sync = simulate(cfg, 0)
        for k in (1, 2):
            bound = ceiling(cfg, k, sync, "streaming")
            assert bound >= ceiling(cfg, k, sync, "barrier") - 1e-9
            for placement, train in (("colocated", None), *(("tagged", t) for t in (1, 2, 4, 6, 7))):
                r = simulate(cfg, k, placement, train, update="streaming")
                assert r.update == "streaming" and r.max_staleness_seen <= k
                assert r.samples_per_s / sync.samples_per_s <= bound * 1.01, (name, k, placement, train)


def test_in_flight_answers_pay_a_second_prefill_after_each_weight_load():
    """Answers still decoding when new weights arrive are prefilled again (their caches came from the old
    weights): charged in async runs, absent from the synchronous run (nothing in flight at an update), and
    slower than the same run with a free prefill would be."""
    sync, async_ = simulate(SMALL, 0), simulate(SMALL, 1, "tagged", 6)
    assert sync.reprefill_tokens == 0 and async_.reprefill_tokens > 0
    free = simulate(replace(SMALL, prefill_token_s=0.0), 1, "tagged", 6)
    assert free.reprefill_tokens > 0 and free.samples_per_s > async_.samples_per_s
    with pytest.raises(KeyeConfigError, match="streaming"):
        simulate(SMALL, 0, update="streaming")
    with pytest.raises(KeyeConfigError, match="update"):
        simulate(SMALL, 1, update="eager")


def test_deterministic_for_a_seed():
    a = simulate(SMALL, 1, "tagged", 3)
    b = simulate(SMALL, 1, "tagged", 3)
    assert a == b
    assert simulate(replace(SMALL, seed=5), 1, "tagged", 3).update_end_s != a.update_end_s


def test_bad_configurations_are_rejected():
    with pytest.raises(KeyeConfigError, match="placement"):
        simulate(SMALL, 1, "split")
    with pytest.raises(KeyeConfigError, match="train_gpus"):
        simulate(SMALL, 1, "tagged")
    with pytest.raises(KeyeConfigError, match="train_gpus"):
        simulate(SMALL, 1, "tagged", 9)
    with pytest.raises(KeyeConfigError, match="max_staleness"):
        simulate(SMALL, -1)
    with pytest.raises(KeyeConfigError, match="warmup_steps"):
        simulate(replace(SMALL, warmup_steps=6))
    with pytest.raises(KeyeConfigError, match="sync_s"):
        simulate(replace(SMALL, sync_s=-1.0))
    with pytest.raises(KeyeConfigError, match="free decoding"):
        simulate(replace(SMALL, decode_step_s=0.0, decode_token_s=0.0))
