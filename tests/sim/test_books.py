"""The simulator's books kept for many steps at once agree with the same books kept step by step:
the page and latency figures, the timeline, the token times and the modeled clock."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qualia.sim.books import Books, TokenTimes
from qualia.sim.clock import ModeledClock
from qualia.sim.engine import Engine
from qualia.sim.workload import Workload


def _books_of(engine):
    tl = engine.timeline
    counters = {k: v for k, v in engine.counters.__dict__.items() if not k.endswith("_s")}
    rows = {k: list(getattr(tl, k)) for k in ("step", "t", "running", "waiting", "pages_used",
                                              "pages_cached", "hit_rate")}
    return counters, rows, engine.latencies(), dict(engine.records)


@pytest.mark.parametrize("num_pages", [60, 400])
def test_books_by_runs_of_steps_equal_books_by_sequence(num_pages):
    wl = Workload(requests=60, seed=5, arrival_rate=50.0, system_prompts=2, share_ratio=0.5,
                  output_len=(40, 120))
    fast = Engine("c", num_pages=num_pages)
    fast.run(wl)
    each = Engine("c", num_pages=num_pages)
    each.books = Books(num_pages, each.config.page_tokens, 1, forking=True)
    each.counters, each.timeline = each.books.counters, each.books.timeline
    each._c = each.counters.__dict__
    each.run(wl)
    got, want = _books_of(fast), _books_of(each)
    if num_pages == 60:
        assert want[0]["preemptions"] > 0
    assert got == want


def _stepped(engine, on_step):
    """Step ``engine`` to the end, calling ``on_step(plans)`` after each step with work with
    what its backend saw of the step's plan: its ``plan_seconds`` on the engine's clock and
    the sum of its ``seq_lens``."""
    clock, inner = engine.clock, engine.backend.execute_step
    plans = []

    def execute(plan):
        plans.append((clock.plan_seconds(plan), int(plan.seq_lens.sum()),
                      plan.num_prefill_tokens == 0 and len(plan.request_ids) > 0))
        return inner(plan)

    engine.backend.execute_step = execute
    while engine.pending:
        seen = len(plans)
        engine.step()
        if len(plans) > seen:
            on_step(plans)
    return plans


@pytest.mark.parametrize("num_pages", [60, 400])
def test_modeled_clock_charges_every_step_its_plan_seconds_bit_for_bit(num_pages):
    engine = Engine("c", num_pages=num_pages)
    assert isinstance(engine.clock, ModeledClock)
    busy = 0.0

    def check(plans):
        nonlocal busy
        busy += plans[-1][0]
        assert engine.busy_s == busy

    wl = Workload(requests=40, seed=2, arrival_rate=30.0, output_len=(20, 90))
    engine.submit_all(wl)
    plans = _stepped(engine, check)
    assert sum(decode for _, _, decode in plans) > 100


@pytest.mark.parametrize("num_pages", [60, 400])
def test_books_context_is_the_sum_of_the_last_plans_seq_lens(num_pages):
    engine = Engine("c", num_pages=num_pages, max_num_batched_tokens=64)
    engine.submit_all(Workload(requests=40, seed=3, arrival_rate=30.0, output_len=(20, 90)))
    wrong = []

    def check(plans):
        if engine.books.context != plans[-1][1]:
            wrong.append((engine.step_no, engine.books.context, plans[-1][1]))

    plans = _stepped(engine, check)
    assert wrong == []
    assert sum(decode for _, _, decode in plans) > 100
    if num_pages == 60:
        assert engine.counters.preemptions > 0


def test_books_keep_no_context_with_forks():
    assert Books(100, 16, 2).context is None
    assert Books(100, 16, 1, forking=True).context is None
    assert Books(100, 16, 1).context == 0


def test_token_times_take_what_each_id_sampled_before_it_completed():
    rng = random.Random(7)
    log, naive = TokenTimes(), {}
    active, fresh = list(range(6)), 6
    done = []  # (ids, steps logged when they completed)
    for step in range(600):
        now = step * 0.5 + rng.random() * 0.1
        log.log(np.array(active, dtype=np.uint64), now)
        for rid in active:
            naive.setdefault(rid, []).append(now)
        if active and rng.random() < 0.15:  # one completes; a group of two now and then
            k = min(len(active), rng.choice([1, 1, 2]))
            gone = rng.sample(active, k)
            active = [r for r in active if r not in gone]
            done.append((gone, step + 1))
        if len(active) < 8 and rng.random() < 0.2:
            active.append(fresh)
            fresh += 1
        if done and rng.random() < 0.1:  # the records are made some steps later
            for ids, before in done:
                want = sorted(t for rid in ids for t in naive.pop(rid))
                assert log.take(ids, before).tolist() == want
            done = []


@pytest.mark.parametrize("num_pages,share", [(60, 0.9), (120, 0.9), (400, 0.5)])
def test_every_timeline_row_equals_the_schedulers_reads_after_the_step(num_pages, share):
    wl = Workload(requests=80, seed=11, arrival_rate=60.0, system_prompts=2, share_ratio=share,
                  output_len=(20, 120), turns=2)
    engine = Engine("c", num_pages=num_pages)
    tl, f, s = engine.timeline, engine.facade, engine.scheduler
    book = engine.books.book
    quiet_rows = 0

    def checked(plan, held, running, live, step, s_, f_, backlog, quiet=False):
        nonlocal quiet_rows
        firsts = book(plan, held, running, live, step, s_, f_, backlog, quiet)
        stats = f.cache_stats()
        lookups = stats.lookup_tokens
        assert (tl.step[-1], tl.running[-1], tl.waiting[-1], tl.pages_used[-1],
                tl.pages_cached[-1], tl.hit_rate[-1]) == (
            step, s.num_running, s.num_waiting + backlog, num_pages - f.free_pages,
            stats.reclaimable_pages, stats.hit_tokens / lookups if lookups else 0.0)
        quiet_rows += bool(quiet and engine.books.steady)
        return firsts

    engine.books.book = checked
    engine.run(wl)
    stats = engine.stats()
    assert quiet_rows > 100
    assert stats["cache_reclaims"] > 0
    if num_pages == 60:
        assert stats["preemptions"] > 0
