"""What the automatic prefix cache costs as the reclaim order scatters.

    python bench/reclaim_order.py [--pool 40800] [--blocks 12] [--steps 5000]

The mixed workload of step_compare.py as a serving engine runs it (steptime.MixedSteady: every
request replaced by a new one when it finishes), with caching off and on, from the step at which
the pool is full: for each block of STEPS steps, the mean ns of a step (schedule + update) in
each mode, what caching adds per page filled ((on - off) / pages filled a step), and, at the
block's end, the share of the reclaimable list's neighbours that are neighbours in memory too.
Just after the pool fills, a reclaim's next page is mostly the adjacent one; each pass of the
pool through the list scatters the order, as the decodes hand back pages they took one at a
time.  step_compare's "pool full" window measures the first state, its "steady" window one
where under 5% of the neighbours are adjacent, about 40,000 steps on at the default pool.
The two modes run one after the other (all blocks off, then all on), so a slow spell of the
machine moves one mode's blocks only: compare runs, not single blocks.
"""

from __future__ import annotations

import argparse
import gc
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from steptime import PT, MixedSteady, steps_to_fill  # noqa: E402

import qualia  # noqa: E402


def run(mode, pool, blocks, steps):
    w = MixedSteady(qualia, pool, mode)
    for _ in range(steps_to_fill(pool)):
        w.step()
    rows = []
    for _ in range(blocks):
        ts, pre = [], 0
        gc.disable()
        try:
            for _ in range(steps):
                pre += w.step(ts)
        finally:
            gc.enable()
        rows.append((sum(ts) / len(ts), pre / len(ts) / PT, w.adjacent()))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool", type=int, default=40800)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5000)
    args = ap.parse_args()
    if args.pool < 5300 or args.blocks < 1 or args.steps < 1:
        ap.error("--pool must be at least 5,300 pages, --blocks and --steps at least 1")
    off = run("off", args.pool, args.blocks, args.steps)
    auto = run("auto", args.pool, args.blocks, args.steps)
    print("| steps after the pool filled | off (ns a step) | on (ns a step) | on - off a page "
          "filled (ns) | reclaim order: neighbours adjacent in memory |")
    print("|---:|---:|---:|---:|---:|")
    for i, ((t0, _, _), (t1, pages, adj)) in enumerate(zip(off, auto)):
        print(f"| {(i + 1) * args.steps:,} | {t0:.0f} | {t1:.0f} | {(t1 - t0) / pages:.1f} "
              f"| {adj:.3f} |")


if __name__ == "__main__":
    main()
