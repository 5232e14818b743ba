"""Timing of the engine step, shared by the benches (step_bench.py, fork_bench.py).

A "step" is ``update(sampled ids)`` + ``schedule()``, timed with ``time.perf_counter_ns`` and
reported as the median of repeated steps, with the garbage collector off while timing.  The
benches set OPENBLAS_NUM_THREADS=1 before numpy is first imported (numpy's BLAS threads spin on
an idle core otherwise); import this module after that.
"""

from __future__ import annotations

import gc
import time

import numpy as np

pc = time.perf_counter_ns
PT = 16
KEY = bytes(range(16))


def median(xs):
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def decoding(cls, n, ctx, extra_pages=8, group=1, **kw):
    """n requests of ctx-token prompts, prefilled, each decoding from now on (with room for
    the decode steps taken while the others prefill, and extra_pages more pages).  With
    group > 1, n // group prompts are added with ``n=group``: one prefill each, forked into
    `group` members at its last chunk."""
    kw.setdefault("max_num_batched_tokens", max(8192, n))
    prefill_steps = n * ctx // max(kw["max_num_batched_tokens"] - n, 1) + 2
    extra_pages += -(-prefill_steps // PT)
    lp = -(-ctx // PT) + extra_pages
    s = cls(n * lp + 8, PT, lp, n, cache_key=KEY, max_queued=n, **kw)
    rng = np.random.default_rng(n + ctx)
    fork = {} if group == 1 else {"n": group}
    for i in range(n // group):
        s.add_request(i, rng.integers(0, 30000, size=ctx, dtype=np.uint32),
                      max_new_tokens=extra_pages * PT - 1, **fork)
    while True:   # prefill every prompt (the first token is sampled at its last chunk)
        plan = s.schedule()
        s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
        if plan.num_prefill_tokens == 0:
            break
    return s


def time_steps(s, steps, ids, mean=False):
    """ns per schedule + update, median of `steps` steps (mean=True: their mean, which counts
    the steps in which pages fill as often as they come)."""
    ts = []
    sched, upd = s.schedule, s.update
    for _ in range(steps):
        t0 = pc()
        upd(ids)
        sched()
        ts.append(pc() - t0)
    return sum(ts) / len(ts) if mean else median(ts)


def decode_cost(cls, n, ctx, steps, group=1):
    """ns per request of the decode-only step of n running requests of ctx-token prompts
    (`group` members per prompt, see decoding)."""
    s = decoding(cls, n, ctx, extra_pages=steps // PT + 2, group=group)
    plan = s.schedule()
    assert plan.num_decode_tokens == n, (plan.num_decode_tokens, n)
    ids = np.zeros(n, dtype=np.uint32)
    gc.disable()
    try:
        t = time_steps(s, steps, ids)
    finally:
        gc.enable()
    return t / n


def steps_to_fill(pool):
    """Steps of the mixed workload (step_compare.py, MixedSteady) after which a pool of `pool`
    pages is full: its 64 decodes hold about 4,800 pages, and a step's 2,048-token chunk fills
    128 more (the default pool's 36,000 free pages from step 282); at least 320."""
    return max(320, -(-(pool - 4800) // 128) + 38)


class MixedSteady:
    """The mixed workload of step_compare.py (64 decoding requests of 512-token prompts and
    8,192-token prompts prefilled in 2,048-token chunks, one step taking 64 decodes and one
    chunk) as a serving engine runs it for a while: every request replaced by a new, distinct
    one (no page is a hit) when it finishes, in a pool of `pool` pages that fills.  A new
    decoding request is queued at a higher priority than the long prompts, so it is admitted
    within a few steps and the step keeps its 64 decodes (in 97% of the steps after the pool
    fills, 63.9 on average).  A decode takes its pages one at a time, so the pages it hands
    back lie apart in memory, and each pass of the pool through the reclaimable list scatters
    that list's order further.

    settle=True prefills the decoding requests before the long prompts are queued (step_compare's
    "with room" and "pool full" windows: every step from then on takes 64 decodes and one chunk,
    as long as no decoding request finishes, 552 steps)."""

    N, CHUNK = 64, 2048

    def __init__(self, qualia, pool, mode, seed=2, settle=False):
        n = self.N
        self.lp = 512 // PT + 40
        self.s = qualia.StepScheduler(pool, PT, 600, n + 1, cache_key=KEY, prefix_caching=mode,
                                      max_num_batched_tokens=n + self.CHUNK, max_queued=n + 96)
        rng = np.random.default_rng(seed)
        self.shorts = [rng.integers(0, 30000, size=512, dtype=np.uint32) for _ in range(n)]
        self.longs = [rng.integers(0, 30000, size=8192, dtype=np.uint32) for _ in range(40)]
        self.z = np.zeros(n + 1, dtype=np.uint32)
        self.rid = 0
        self.short_ids = set()
        for _ in range(n):
            self.add(True)
        while settle and self.step():
            pass
        for _ in range(80):
            self.add(False)

    def add(self, short):
        rid = self.rid
        prompts = self.shorts if short else self.longs
        p = prompts[rid % len(prompts)].copy()
        p[0] = rid
        self.s.add_request(rid, p, max_new_tokens=self.lp * PT - 600 if short else 1,
                           priority=0 if short else 1)
        if short:
            self.short_ids.add(rid)
        self.rid += 1

    def step(self, ts=None):
        """One step (schedule + update, its ns appended to ts if given; the replacements are
        not timed); returns the step's prefill tokens."""
        t0 = pc()
        plan = self.s.schedule()
        done = self.s.update(self.z[:len(plan.logits_indices)])
        if ts is not None:
            ts.append(pc() - t0)
        for f in done:
            short = f.request_id in self.short_ids
            self.short_ids.discard(f.request_id)
            self.add(short)
        return plan.num_prefill_tokens

    def adjacent(self):
        """The share of the reclaimable list's neighbours that are neighbours in memory too
        (pages p and p +- 1): near 1 just after the pool first fills, near 0 once the order
        is scattered (nan with caching off: no list)."""
        order = self.s.reclaimable_pages().astype(np.int64)
        return float(np.mean(np.abs(np.diff(order)) == 1)) if len(order) > 1 else float("nan")
