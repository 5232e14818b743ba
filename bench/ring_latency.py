"""How long single steps take while the page cache's reclaim ring compacts: builds side by side.

    python bench/ring_latency.py BASE_TREE THIS_TREE [--pool 262144] [--pages 2048]
                                 [--cycles 400] [--rounds 3] [--dead-run]

The workload keeps the ring busy with dead entries: a pool of --pool pages is filled with
cached prompts of --pages pages each (all reclaimable), then the same prompts are served again
and again, one at a time (a hit on every full page but the last): each admission retakes the
prompt's pages off the reclaimable list (leaving dead entries in the ring) and its finish
appends them again.  The ring fills with dead entries at --pages a cycle and is compacted as
it goes.  Each step (schedule + update) of --cycles cycles is timed; a tree's figures are
from the round (a child process) with the lowest mean, and per step: the mean, the median,
the 99th percentile and the largest.  The mean is the work; the largest is the latency a
serving engine sees when one call does a whole compaction.

With --dead-run the workload is the head's worst case instead: the pool filled as above with
one prompt's worth of pages left free, every prompt served once more (a hit on each: a pool's
worth of dead entries at the ring's head, and not one reclaim, as a prompt's last page takes a
free page and gives it back), then two new prompts: the first takes the free pages, the second
reclaims its pages from the head, which first passes every dead entry.  The figures are that
last prompt's step and, beside it, the first's (the same step without the pass).

Each tree is a checkout with the extension built in place; the trees alternate round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from treerun import rotated, run_child

HERE = os.path.dirname(os.path.abspath(__file__))


def child(pool, pages, cycles, dead_run):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    sys.path.insert(0, HERE)
    import gc

    import numpy as np
    from steptime import KEY, PT, pc

    import qualia

    s = qualia.StepScheduler(pool, PT, pages + 2, 4, cache_key=KEY, prefix_caching="auto",
                             max_num_batched_tokens=pages * PT + 64, max_queued=8)
    rng = np.random.default_rng(0)
    # two prompts' worth of pages left free (one with --dead-run)
    prompts = [rng.integers(0, 30000, size=pages * PT, dtype=np.uint32)
               for _ in range(pool // pages - (1 if dead_run else 2))]
    z = np.zeros(4, dtype=np.uint32)

    def serve(p, rid, ts):
        s.add_request(rid, p, max_new_tokens=1)
        while True:
            t0 = pc()
            plan = s.schedule()
            done = s.update(z[:len(plan.logits_indices)])
            ts.append(pc() - t0)
            if done:
                return

    rid, ts = 0, []
    for p in prompts:                   # every page of the pool cached and reclaimable
        serve(p, rid, [])
        rid += 1
    if dead_run:
        for p in prompts:               # a hit on every prompt: its entries die at the head
            serve(p, rid, [])
            rid += 1
        reclaims = s.cache_stats().reclaims
        first, last = [], []
        gc.disable()
        try:
            for t in (first, last):
                serve(rng.integers(0, 30000, size=pages * PT, dtype=np.uint32), rid, t)
                rid += 1
        finally:
            gc.enable()
        assert s.cache_stats().reclaims - reclaims >= pages, "the last prompt reclaimed nothing"
        print(json.dumps({"qualia": os.path.dirname(qualia.__file__), "steps": 1,
                          "first": max(first) / 1e3, "mean": max(last) / 1e3}))
        return
    gc.disable()
    try:
        for i in range(cycles):
            serve(prompts[i % len(prompts)], rid, ts)
            rid += 1
    finally:
        gc.enable()
    us = np.asarray(ts, dtype=np.float64) / 1e3
    print(json.dumps({"qualia": os.path.dirname(qualia.__file__), "steps": len(us),
                      "mean": float(us.mean()), "median": float(np.median(us)),
                      "p99": float(np.percentile(us, 99)), "max": float(us.max())}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*")
    ap.add_argument("--pool", type=int, default=262144, help="pages in the pool")
    ap.add_argument("--pages", type=int, default=2048, help="pages a prompt")
    ap.add_argument("--cycles", type=int, default=400, help="prompts served, timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dead-run", action="store_true",
                    help="time one reclaim after a pool's worth of dead entries at the head")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.pages < 1 or args.pool < 4 * args.pages:
        ap.error(f"--pool must hold at least four prompts of --pages pages (got --pool "
                 f"{args.pool}, --pages {args.pages})")
    if args.cycles < 1 or args.rounds < 1:
        ap.error("--cycles and --rounds must be at least 1")
    if args.child:
        child(args.pool, args.pages, args.cycles, args.dead_run)
        return
    trees = [os.path.abspath(t) for t in args.trees]
    if not trees:
        ap.error("name at least one tree")
    best = [None] * len(trees)
    for rnd in range(args.rounds):
        for i in rotated(len(trees), rnd):
            r = run_child(os.path.abspath(__file__), trees[i],
                          ["--pool", str(args.pool), "--pages", str(args.pages),
                           "--cycles", str(args.cycles)] + (["--dead-run"] * args.dead_run))
            if best[i] is None or r["mean"] < best[i]["mean"]:
                best[i] = r
    if args.dead_run:
        print(f"pool {args.pool} pages, prompts of {args.pages} pages: a pool's worth of dead "
              f"entries at the head, then a prompt that reclaims, us a step, the lowest of "
              f"{args.rounds} rounds")
        print("| tree | the step reclaiming past the dead entries | the step before (no "
              "reclaim) |")
        print("|---|---:|---:|")
        for t, r in zip(trees, best):
            print(f"| {os.path.basename(t)} | {r['mean']:.0f} | {r['first']:.0f} |")
        return
    print(f"pool {args.pool} pages, prompts of {args.pages} pages, {args.cycles} served "
          f"({best[0]['steps']} steps), us a step, the round of lowest mean of {args.rounds}")
    print("| tree | mean | median | p99 | max |")
    print("|---|---:|---:|---:|---:|")
    for t, r in zip(trees, best):
        print(f"| {os.path.basename(t)} | {r['mean']:.0f} | {r['median']:.0f} | {r['p99']:.0f} "
              f"| {r['max']:.0f} |")


if __name__ == "__main__":
    main()
