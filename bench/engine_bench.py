"""End to end on the built-in C hash backend: generated tokens per second of one workload served
three ways, in one run, on the compiled core's engine step:

  engine   qualia.sim.engine.Engine("c"): what ``qualia simulate --backend c`` runs -- the Python
           serving loop (arrivals, books, timeline, first tokens) around add_request /
           schedule / execute_step / update
  loop     the bare Python loop: every request added up front, then schedule() ->
           HashBackend.execute_step(plan) -> update() until idle, nothing else
  run      StepScheduler.run(HashBackend): the same loop entirely in C, without the GIL

The workload is simulate's default shape with one turn (``--turns 1``: run() cannot submit a
conversation's next turn) and every request arriving at once; the scheduler is simulate's
default (24 slots, 96 pages of 16 tokens, 16 pages per request, 2,048-token budget).  Every
request's tokens are compared across the three before anything is reported (the hash rule does
not depend on batching or preemption).  Figures: tokens / wall seconds of the serving part
(submission included, workload generation not); best of ``--repeat``.

Run: ``python bench/engine_bench.py`` (``--requests N``, ``--repeat K``; ``--engine-only`` for the
engine alone, with a digest of every output to compare with another install's run).  Figures:
bench/RESULTS-step.md.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import qualia  # noqa: E402
from qualia.sim.engine import Engine  # noqa: E402
from qualia.sim.workload import Workload  # noqa: E402

CFG = dict(max_num_seqs=24, num_pages=96, page_tokens=16, logical_pages=16)
BUDGET = 2048


def requests(n, seed):
    return list(Workload(requests=n, seed=seed, arrival_rate=float("inf"), turns=1,
                         vocab=32000).generate())


def by_engine(reqs):
    try:
        eng = Engine("c", max_num_batched_tokens=BUDGET, **CFG)
    except TypeError:   # the engine before the step API: decode rounds, no token budget
        eng = Engine("c", **CFG)
    t0 = time.perf_counter()
    eng.submit_all(reqs)
    res = eng.run()
    t = time.perf_counter() - t0
    stats = res.stats if hasattr(res, "stats") else eng.stats()
    assert stats["requests_completed"] == len(reqs)
    return t, {rid: list(map(int, o)) for rid, o in eng.outputs.items()}, stats["steps"]


def _scheduler(n):
    c = CFG
    return qualia.StepScheduler(c["num_pages"], c["page_tokens"], c["logical_pages"],
                                c["max_num_seqs"], max_num_batched_tokens=BUDGET, max_queued=n,
                                vocab_size=32000)


def _add(s, reqs):
    for q in reqs:
        s.add_request(q.request_id, np.asarray(q.prompt, dtype=np.uint32),
                      max_new_tokens=q.max_new_tokens, namespace=q.namespace, ignore_eos=True)


def by_loop(reqs):
    s = _scheduler(len(reqs))
    hb = qualia.HashBackend()
    out, steps = {}, 0
    t0 = time.perf_counter()
    _add(s, reqs)
    while s.has_unfinished():
        plan = s.schedule()
        for f in s.update(hb.execute_step(plan)):
            out[int(f.request_id)] = np.asarray(f.output_tokens).tolist()
        steps += 1
    return time.perf_counter() - t0, out, steps


def by_run(reqs):
    s = _scheduler(len(reqs))
    hb = qualia.HashBackend()
    t0 = time.perf_counter()
    _add(s, reqs)
    r = s.run(hb)
    t = time.perf_counter() - t0
    out = {int(f.request_id): np.asarray(f.output_tokens).tolist() for f in r.finished}
    return t, out, r.steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--engine-only", action="store_true",
                    help="only the engine; prints a digest of every output to compare "
                         "with another run")
    args = ap.parse_args()
    reqs = requests(args.requests, args.seed)
    best = {}
    outs = {}
    ways = [("engine", by_engine)]
    if not args.engine_only:
        ways += [("loop", by_loop), ("run", by_run)]
    for _ in range(args.repeat):
        for name, fn in ways:
            t, out, steps = fn(reqs)
            outs[name] = out
            if name not in best or t < best[name][0]:
                best[name] = (t, steps)
    import hashlib
    digest = hashlib.sha256(repr(sorted(outs["engine"].items())).encode()).hexdigest()[:16]
    if not args.engine_only:
        assert outs["engine"] == outs["loop"] == outs["run"], "the three disagree on tokens"
    tokens = sum(len(o) for o in outs["engine"].values())
    print(f"{len(reqs)} requests, {tokens} tokens generated (outputs sha256 {digest}), "
          f"best of {args.repeat}")
    print("| way | steps | seconds | generated tokens / s | x engine |")
    print("|---|---:|---:|---:|---:|")
    base = tokens / best["engine"][0]
    for name, _ in ways:
        t, steps = best[name]
        print(f"| {name} | {steps} | {t:.4f} | {tokens / t:,.0f} | {tokens / t / base:.1f}x |")


if __name__ == "__main__":
    main()
