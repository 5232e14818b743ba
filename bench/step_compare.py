"""The engine step's figures for two builds side by side, in one run.

    python bench/step_compare.py BASE_TREE THIS_TREE [--rounds 10] [--quick] [--mixed-pool N]
    python bench/step_compare.py BASE_TREE THIS_TREE --paired [--windows 24] [--figure NAME]...

Each tree is a checkout with the extension built in place.  Every figure is measured in a child
interpreter whose ``qualia`` is the tree's (PYTHONPATH=tree), by this file's own code, the trees
alternating round after round; a figure is the lowest over the rounds of its median or mean
(as each says below), and a ratio or the page fill is computed from the figures shown.

Beside every tree after the first, a column compares it with the first round by round (each
round runs every tree once, in an order that rotates from round to round, so a slow spell of
the machine moves the trees of a round together): the median over the rounds of the
difference (this tree's figure minus the first's), in how many rounds it was lower and higher,
and a two-sided sign test's p: how often rounds split at least that unevenly when the two
builds are the same.  For the ratios and page fills the rounds' own figures are compared (each
from its round's mixed windows), not the lowest figures of the columns beside.  The smallest p
n rounds can give is 2^(1-n): below 0.05 takes 6 rounds without a tie.  A difference of a few
percent is a change only where p is small; two builds of the same code differ by about that
much in their lowest figures, with p down to 0.01 now and then.

The paired mode (--paired) resolves a decode figure to a few ns where rounds minutes apart do
not: one child a tree, kept for the run, measures the named decode figures (default: n=4096
ctx=512, both modes; --steps steps each, 64 by default) on a new workload per window, the
trees alternating window by window (the order rotating), so the values a window pairs are
seconds apart.  A tree's figure is then its median over the windows, and the column beside
compares the windows pairwise as the rounds are compared above.  The same tree named twice
gives an A/A run: the noise of the machine at that moment.

  decode n=N ctx=C mode=M   ns per request of a decode-only step (update + schedule): N running
                            requests of C-token context, the mean over whole periods of 16
                            steps, in which every request fills one page (prompts prefilled
                            over one or more steps: the fills come in as many steps)
  decode no-fill ...       the same with every prompt prefilled in one step: the requests
                            fill their pages in the same step, one step in 16, and the median
                            step (the figure) fills none
  mixed mode=M              one step of 64 decodes plus a 2,048-token prefill chunk, ns (the
                            mean over whole periods of admitting and prefilling 8,192-token
                            prompts; the lowest of three such windows per round, the two
                            modes alternating)
  page fill                 (mixed auto - mixed off) / pages filled in the step: every cost the
                            automatic prefix cache adds per page it takes (hash, index, LRU,
                            events, bookkeeping)
  mixed pool full ...       the same after 320 untimed steps, which fill the pool: with caching
  page fill pool full       on, every page the window allocates is a reclaimed one (checked), as
                            in a serving engine whose cache holds all it can; the page fill then
                            includes the reclaim (the index removal, the lists, the event).
                            --mixed-pool N sizes that pool (default 40,800 pages); below the
                            default only this regime and the next are measured.  Just after
                            the warm-up the reclaimable list still holds the pool's pages
                            mostly in the order they lie in memory, so a reclaim's next page
                            is the adjacent one: the favourable case
  mixed steady ...          the same workload as a serving engine runs it for a while: the pool
  page fill steady          full, every decode request replaced by a new one when it finishes,
                            after about one step per page of the pool, when the reclaim order
                            is scattered across memory (checked: under 5% of a reclaim's next
                            pages adjacent); the lowest mean of three windows of 480 steps
  churn mode=M              ns per generated token, 256 running requests of 512-token prompts
                            generating 256 tokens each, a new one queued as each finishes, in a
                            pool that stays full: admissions, page fills, finishes and (with
                            caching on) reclaims at their steady rate; the cost per token
                            includes the new requests' add_request
  add_request numpy / list  ns per token of 4,096-token prompts
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys

from treerun import check_qualia, child_env, rotated, run_child

HERE = os.path.dirname(os.path.abspath(__file__))
MIXED_POOL = (64 + 4) * 600     # the mixed workload's pool: room for its first window


DECODE = re.compile(r"decode( no-fill)? n=(\d+) ctx=(\d+) mode=(off|auto)")
PAIRED = ("decode n=4096 ctx=512 mode=off", "decode n=4096 ctx=512 mode=auto")


def child_imports():
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    sys.path.insert(0, HERE)
    import qualia
    return qualia


def decode_figure(qualia, name, steps):
    """The decode figure `name` (DECODE's form, as the table names it): a new workload, timed
    over `steps` steps (whole periods of PT steps)."""
    import gc

    import numpy as np
    from steptime import PT, decoding, time_steps

    m = DECODE.fullmatch(name)
    aligned, n, ctx, mode = m[1] is not None, int(m[2]), int(m[3]), m[4]
    # aligned: every prompt prefilled in one step, so every request fills a page in the same
    # step (one in PT); otherwise the prompts prefill over several steps and the page fills
    # spread evenly over the steps (a PT-th of the requests fill a page in each step)
    kw = {"max_num_batched_tokens": n * ctx + n} if aligned else {}
    s = decoding(qualia.StepScheduler, n, ctx, extra_pages=steps // PT + 2,
                 prefix_caching=mode, **kw)
    s.schedule()
    ids = np.zeros(n, dtype=np.uint32)
    gc.disable()
    try:
        return time_steps(s, steps, ids, mean=not aligned) / n
    finally:
        gc.enable()


def serve(steps):
    # the paired mode's child: the tree's qualia, then one figure for each name read
    qualia = child_imports()
    print(json.dumps(os.path.dirname(qualia.__file__)), flush=True)
    for line in sys.stdin:
        print(json.dumps(decode_figure(qualia, line.strip(), steps)), flush=True)


def child(quick, mixed_pool):
    qualia = child_imports()
    import gc

    import numpy as np
    from steptime import KEY, PT, MixedSteady, pc, steps_to_fill

    out = {"qualia": os.path.dirname(qualia.__file__)}
    steps = 32 if quick else 64     # whole periods of PT steps

    def decode(n, ctx, mode, aligned=False):
        fill = " no-fill" if aligned else ""
        return decode_figure(qualia, f"decode{fill} n={n} ctx={ctx} mode={mode}", steps)

    sizes = (64, 256, 1024) if quick else (64, 256, 1024, 4096)
    ctxs = (128, 2048, 8192) if quick else (128, 2048, 8192, 32768)
    for mode in ("off", "auto"):
        for n in sizes:
            out[f"decode n={n} ctx=512 mode={mode}"] = decode(n, 512, mode)
        for c in ctxs:
            out[f"decode n=128 ctx={c} mode={mode}"] = decode(128, c, mode)
        for n, c in ((64, 512), (1024, 512), (128, 8192)):
            out[f"decode no-fill n={n} ctx={c} mode={mode}"] = decode(n, c, mode, True)

    def mixed(mode, full):
        # full: the pool is filled first (untimed), so that every page the window allocates
        # with caching on comes from a reclaim, as in a serving engine whose cache holds all
        # it can; otherwise the window's pages all come from the free stack
        w = MixedSteady(qualia, mixed_pool, mode, seed=1, settle=True)
        for _ in range(steps_to_fill(mixed_pool) if full else 0):
            w.step()
        reclaims = w.s.cache_stats().reclaims if mode == "auto" else 0
        ts, pre = [], 0
        gc.disable()
        try:
            for _ in range(12 if quick else 120):
                pre += w.step(ts)
        finally:
            gc.enable()
        if full and mode == "auto":
            # every page allocated in the window was reclaimed: the pool stayed full
            assert w.s.cache_stats().reclaims - reclaims >= pre // PT, "pool not full"
        # the mean over whole periods (120 steps, or 12: 30 or 3 prompts of four 2,048-token
        # chunks, each admitted and hashed in its first): a median picks a light or a heavy step
        return sum(ts) / len(ts), pre / len(ts)

    # three windows per mode, the modes alternating, each mode's lowest kept: one window in
    # which the machine slowed moves neither mode's figure nor the ratio
    # a pool smaller than the default fills within the first regime's window: that regime is
    # then not "with room", and only the full pool is measured
    for full in (False, True) if mixed_pool >= MIXED_POOL else (True,):
        best = {"off": float("inf"), "auto": float("inf")}
        for _ in range(1 if quick else 3):
            for mode in best:
                t, pre = mixed(mode, full)
                best[mode] = min(best[mode], t)
        off, auto = best["off"], best["auto"]
        tag = " pool full" if full else ""
        out[f"mixed{tag} mode=off"] = off
        out[f"mixed{tag} mode=auto"] = auto
        out[f"mixed{tag} auto / off"] = auto / off
        out[f"page fill{tag} (ns per page)"] = (auto - off) / (pre / PT)
        out[f"mixed{tag} pages per step"] = pre / PT

    def steady(mode):
        # MixedSteady after about one step per page of the pool: its reclaim order scattered
        # (checked: under 5% of a reclaim's next pages adjacent in memory, where just after the
        # warm-up of "pool full" about 99% are); the lowest mean of three windows of 480 steps,
        # with the pages filled in that window
        w = MixedSteady(qualia, mixed_pool, mode)
        for _ in range(steps_to_fill(mixed_pool) + mixed_pool):
            w.step()
        if mode == "auto":
            assert w.adjacent() < 0.05, f"reclaim order not scattered: {w.adjacent():.2f}"
        best, pages = float("inf"), 0.0
        gc.disable()
        try:
            for _ in range(3):
                ts, pre = [], 0
                for _ in range(48 if quick else 480):
                    pre += w.step(ts)
                mean = sum(ts) / len(ts)
                if mean < best:
                    best, pages = mean, pre / len(ts) / PT
        finally:
            gc.enable()
        return best, pages

    for mode in ("off", "auto"):
        out[f"mixed steady mode={mode}"], pages = steady(mode)
    out["mixed steady auto / off"] = out["mixed steady mode=auto"] / out["mixed steady mode=off"]
    out["page fill steady (ns per page)"] = (
        (out["mixed steady mode=auto"] - out["mixed steady mode=off"]) / pages)
    out["mixed steady pages per step"] = pages

    def churn(mode):
        # 256 running requests of 512-token prompts generating 256 tokens each, a new one
        # queued for each that finishes; the pool is sized so that it fills: in the window,
        # admissions, page fills, finishes and reclaims go on at their steady rate
        n, steps = 256, 600 if quick else 3000
        s = qualia.StepScheduler(n * 52 + 64, PT, 64, n, cache_key=KEY, prefix_caching=mode,
                                 max_num_batched_tokens=8192, max_queued=4 * n)
        rng = np.random.default_rng(3)
        prompts = [rng.integers(0, 30000, size=512, dtype=np.uint32) for _ in range(8 * n)]
        z = np.zeros(n, dtype=np.uint32)
        rid = 0

        def step():
            nonlocal rid
            plan = s.schedule()
            for _ in s.update(z[:len(plan.logits_indices)]):
                s.add_request(rid, prompts[rid % len(prompts)], max_new_tokens=256)
                rid += 1
            return len(plan.logits_indices)

        for _ in range(2 * n):
            s.add_request(rid, prompts[rid], max_new_tokens=256)
            rid += 1
        for _ in range(400):    # past the first wave: the pool is full from here on
            step()
        toks = 0
        gc.disable()
        try:
            t0 = pc()
            for _ in range(steps):
                toks += step()
            t = pc() - t0
        finally:
            gc.enable()
        return t / toks

    off = churn("off")
    auto = churn("auto")
    out["churn mode=off (ns per token)"] = off
    out["churn mode=auto (ns per token)"] = auto
    out["churn auto / off"] = auto / off

    n, reps = 4096, 16 if quick else 64
    arr = np.arange(n, dtype=np.uint32)
    lst = arr.tolist()
    for kind, prompt in (("numpy", arr), ("list", lst)):
        best = float("inf")
        for _ in range(3):
            s = qualia.StepScheduler(8 * 300, PT, 300, 8, cache_key=KEY, max_queued=reps)
            gc.disable()
            t0 = pc()
            for i in range(reps):
                s.add_request(i, prompt, max_new_tokens=8)
            t = (pc() - t0) / (reps * n)
            gc.enable()
            best = min(best, t)
        out[f"add_request {kind} (ns per token)"] = best
    print(json.dumps(out))


def sign_test(lower, higher):
    # two-sided: the chance that rounds of two equal builds split at least as unevenly (ties,
    # rounds with no difference, left out)
    n = lower + higher
    tail = sum(math.comb(n, i) for i in range(min(lower, higher) + 1))
    return min(1.0, 2 * tail / 2 ** n) if n else 1.0


def paired(base, runs, key):
    # this tree against the first, round by round: the median difference, the rounds in which
    # this tree's figure was the lower, and the sign test's p
    d = [r[key] - b[key] for b, r in zip(base, runs)]
    lower, higher = sum(x < 0 for x in d), sum(x > 0 for x in d)
    med = statistics.median(d)
    num = f"{med:+.2f}" if abs(med) < 10 else f"{med:+.1f}"
    return f"{num} ({lower} lower, {higher} higher of {len(d)}, p={sign_test(lower, higher):.2g})"


def run_paired(trees, names, windows, steps):
    """The paired mode: for each tree in order (the same tree may come twice: an A/A run shows
    the noise), {figure: [one value a window]}.  One child a tree, kept for the whole run; in
    each window every child measures every figure once, the trees in an order that rotates
    from window to window, so the values a window pairs are seconds apart."""
    kids = []
    try:
        for t in trees:
            kids.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve", "--steps", str(steps)],
                env=child_env(t), cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True))
            check_qualia(t, json.loads(kids[-1].stdout.readline()))
        vals = [{k: [] for k in names} for _ in trees]
        for w in range(windows):
            for k in names:
                for i in rotated(len(trees), w):
                    kids[i].stdin.write(k + "\n")
                    kids[i].stdin.flush()
                    line = kids[i].stdout.readline()
                    if not line:
                        raise RuntimeError(f"the child for {trees[i]} ended "
                                           f"(exit {kids[i].wait()})")
                    vals[i][k].append(json.loads(line))
        return vals
    finally:
        for kid in kids:
            kid.stdin.close()
            kid.wait()


def paired_table(trees, vals):
    """The paired mode's table (vals as run_paired returns them): each tree's median over the
    windows, and each tree after the first against it window by window (median difference,
    windows lower and higher, p)."""
    names = [os.path.basename(t) for t in trees]
    keys = list(vals[0])
    n = len(vals[0][keys[0]])
    rows = [[{k: v[k][w] for k in keys} for w in range(n)] for v in vals]
    vs = [f"{m} - {names[0]} by window" for m in names[1:]]
    lines = ["| figure | " + " | ".join(names + vs) + " |",
             "|---|" + "---:|" * (len(trees) + len(vs))]
    for k in keys:
        cells = [f"{statistics.median(v[k]):.1f}" for v in vals]
        cells += [paired(rows[0], r, k) for r in rows[1:]]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--paired", action="store_true",
                    help="decode figures in paired windows (see --figure, --windows)")
    ap.add_argument("--windows", type=int, default=24,
                    help="the paired mode's windows (default 24)")
    ap.add_argument("--figure", action="append", default=None,
                    help="a decode figure for the paired mode, named as in the table "
                         "(repeatable; default: n=4096 ctx=512, both modes)")
    ap.add_argument("--steps", type=int, default=64,
                    help="the paired mode: steps a decode figure times (whole periods of 16; "
                         "default 64)")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--mixed-pool", type=int, default=MIXED_POOL,
                    help="pages in the mixed workload's pool (at least 5,300: the 64 decodes "
                         "and one prompt; below the default, the pool full regime only)")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.mixed_pool < 5300:
        ap.error(f"--mixed-pool must be at least 5,300 pages, got {args.mixed_pool}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.steps < 16 or args.steps % 16:
        ap.error(f"--steps must be a positive multiple of 16, got {args.steps}")
    if args.child:
        child(args.quick, args.mixed_pool)
        return
    if args.serve:
        serve(args.steps)
        return
    trees = [os.path.abspath(t) for t in args.trees]
    if not trees:
        ap.error("name at least one tree")
    if args.paired:
        names = args.figure or list(PAIRED)
        for k in names:
            if not DECODE.fullmatch(k):
                ap.error(f"--figure must name a decode figure as the table does "
                         f"(e.g. {PAIRED[1]!r}), got {k!r}")
        if args.windows < 1:
            ap.error(f"--windows must be at least 1, got {args.windows}")
        print(paired_table(trees, run_paired(trees, names, args.windows, args.steps)))
        return
    # by position: the same tree may come twice (an A/A run shows the noise)
    runs = [[] for _ in trees]
    for rnd in range(args.rounds):
        # the order rotates from round to round, so that no tree always runs first in a round
        for i in rotated(len(trees), rnd):
            opts = (["--quick"] if args.quick else []) + ["--mixed-pool", str(args.mixed_pool)]
            r = run_child(os.path.abspath(__file__), trees[i], opts)
            runs[i].append(r)
    keys = [k for k in runs[0][0] if "pages per step" not in k]
    best = [{k: min(r[k] for r in rs) for k in keys} for rs in runs]
    for b, rs in zip(best, runs):
        # the derived figures come from the figures shown, not from one round each (a round
        # in which the machine slowed one mode only would make its own ratio)
        for tag in ("", " pool full", " steady"):
            if f"mixed{tag} pages per step" not in rs[0]:
                continue
            pages = rs[0][f"mixed{tag} pages per step"]
            b[f"mixed{tag} auto / off"] = b[f"mixed{tag} mode=auto"] / b[f"mixed{tag} mode=off"]
            b[f"page fill{tag} (ns per page)"] = (
                (b[f"mixed{tag} mode=auto"] - b[f"mixed{tag} mode=off"]) / pages)
        b["churn auto / off"] = (b["churn mode=auto (ns per token)"]
                                 / b["churn mode=off (ns per token)"])
    names = [os.path.basename(t) for t in trees]
    vs = [f"{n} - {names[0]} by round" for n in names[1:]]
    print("| figure | " + " | ".join(names + vs) + " |")
    print("|---|" + "---:|" * (len(trees) + len(vs)))
    for k in keys:
        vals = [b[k] for b in best]
        cells = [f"{v:.2f}" if v < 10 else f"{v:.1f}" for v in vals]
        cells += [paired(runs[0], rs, k) for rs in runs[1:]]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
