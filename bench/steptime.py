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
