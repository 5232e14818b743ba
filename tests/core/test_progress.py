"""Progress of the engine step (docs/DESIGN.md, "Progress"): every workload the scheduler
accepts finishes, within a number of steps computed from the workload.

The bound is the argument of DESIGN, "Progress", counted: an *event* is a token appended to a
plain request or to a member of an ``n`` group (the fork of an ``n`` group's members included),
a beam getting its candidates, or a beam group's selection.  A workload has at most

    E = sum(max_new) over plain requests + sum(n * max_new) over n groups
        + sum((w + 1) * max_new) over beam groups

events, and between two events at most ``2 + P * L`` steps run, with ``P`` the number of
distinct priorities and ``L`` the longest request (prompt plus max_new_tokens).  So a workload
finishes within ``E + (E + 1) * (2 + P * L)`` steps.

Both schedulers are driven: the compiled core through ``run(HashBackend())`` (the loop in C, with
``max_steps`` set to the bound) and the twin (``qualia.twin.StepScheduler``) step by step, and their
results must agree.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.step_checks import assert_same_plan

import qualia
from qualia.errors import StepError
from qualia.twin import StepScheduler as TwinStepScheduler

V = 64
HB = qualia.HashBackend(vocab=V)


def step_bound(requests):
    """The number of steps within which ``requests`` (``(id, prompt, kwargs)``, the accepted
    ones) finish: docs/DESIGN.md, "Progress"."""
    events = 0
    for _, _, kw in requests:
        new = kw["max_new_tokens"]
        if kw.get("beam_width") is not None:
            events += (kw["beam_width"] + 1) * new
        else:
            events += kw.get("n", 1) * new
    priorities = len({kw.get("priority", 0) for _, _, kw in requests})
    longest = max(len(prompt) + kw["max_new_tokens"] for _, prompt, kw in requests)
    return events + (events + 1) * (2 + priorities * longest)


def add_all(s, requests):
    """Add ``requests``; returns the accepted ones."""
    taken = []
    for rid, prompt, kw in requests:
        try:
            s.add_request(rid, prompt, **kw)
        except (StepError.NeverFits, StepError.QueueFull, ValueError):
            continue
        taken.append((rid, prompt, kw))
    return taken


def execute(plan):
    return HB.execute_step_topk(plan) if plan.num_topk else (HB.execute_step(plan),)


def results(finished):
    out = []
    for f in finished:
        if isinstance(f, qualia.FinishedGroup):
            out.append((f.request_id, [o.tolist() for o in f.outputs], f.finish_reasons,
                        f.scores, f.member_ids))
        else:
            out.append((f.request_id, f.output_tokens.tolist(), f.finish_reason))
    return out


def run_core(args, kw, requests):
    s = qualia.StepScheduler(*args, vocab_size=V, **kw)
    taken = add_all(s, requests)
    if not taken:
        return s, taken, None, 0
    bound = step_bound(taken)
    r = s.run(HB, max_steps=bound)
    assert not s.has_unfinished(), (f"{len(taken)} requests, still unfinished after the bound "
                                    f"of {bound} steps ({s.parked} beams parked)")
    assert s.free_pages == s.num_pages
    return s, taken, r, bound


def drive_lockstep(args, kw, requests):
    """Core and twin step by step, plan for plan, until both are done or the bound is
    reached; returns (core, twin, finished, steps, bound)."""
    c = qualia.StepScheduler(*args, vocab_size=V, **kw)
    t = TwinStepScheduler(*args, vocab_size=V, **kw)
    taken = add_all(c, requests)
    assert add_all(t, requests) == taken
    bound = step_bound(taken) if taken else 0
    finished, steps = [], 0
    while (c.has_unfinished() or t.has_unfinished()) and steps < bound:
        pc, pt = c.schedule(), t.schedule()
        assert_same_plan(pc, pt)
        done = c.update(*execute(pc))
        assert results(done) == results(t.update(*execute(pt)))
        finished += done
        steps += 1
    return c, t, finished, steps, bound


# -- workloads that cycled for ever: admit prompts, schedule nothing, park them again -------------

# beam groups only, one width, priority 0 (the shape `qualia simulate --beam-width` submits):
# each group needs its two beams computed, and the two beams of one group never ran side by side
SAME_WIDTH = ((9, 2, 11, 2), dict(max_num_batched_tokens=10, max_queued=12, cache_key=b"s" * 16),
              [(0, [1, 2, 3, 28], dict(max_new_tokens=1, beam_width=2)),
               (2, [1, 2, 3, 4, 26, 50, 33, 22, 34, 51, 11, 27, 44, 62],
                dict(max_new_tokens=2, beam_width=2)),
               (5, [33, 56, 1, 18, 16, 50, 56], dict(max_new_tokens=2, beam_width=2))])

# a beam group of width 4 beside another beam group and a plain request, 13 pages: once its
# beams had recomputed the prompt into pages of their own, two of them filled the pool
MIXED = ((13, 2, 12, 4), dict(max_num_batched_tokens=12, max_prefill_chunk=8,
                             cache_key=b"s" * 16),
         [(0, [0, 1, 2, 3, 4, 5, 5, 62, 5, 38, 63, 57], dict(max_new_tokens=3, beam_width=4)),
          (1, [0, 1, 2, 3, 4, 5, 55, 46, 39, 35, 62, 63, 10, 28],
           dict(max_new_tokens=1, priority=-1, beam_width=2)),
          (2, [6, 32, 3, 13, 36, 61, 15, 12, 22, 9, 15], dict(max_new_tokens=1, eos_token_id=3))])


@pytest.mark.parametrize("workload", [SAME_WIDTH, MIXED], ids=["same_width_beams", "mixed"])
def test_parked_beams_keep_their_candidates_and_the_workload_finishes(workload):
    args, kw, requests = workload
    c, t, finished, steps, bound = drive_lockstep(args, kw, requests)
    assert not c.has_unfinished() and not t.has_unfinished(), \
        f"unfinished after {steps} steps (bound {bound}), {c.parked} beams parked"
    assert c.parked == t.parked > 0         # the case these workloads are about
    assert len(finished) == len(requests)
    assert c.free_pages == c.num_pages
    _, _, r, _ = run_core(args, kw, requests)
    assert results(r.finished) == results(finished)


# -- every accepted workload finishes within the bound --------------------------------------------

def workload(seed):
    """A random workload: a tiny pool, budget and slot count, caching on or off, plain
    requests, n groups and beam groups of several priorities, prompts that share prefixes."""
    rng = np.random.default_rng(seed)
    pt = int(rng.choice([2, 4]))
    lp = int(rng.integers(4, 13))
    nb = int(rng.integers(4, 30))
    mr = int(rng.integers(1, 6))
    seqs = int(rng.integers(1, mr + 1))
    kw = dict(max_num_batched_tokens=int(rng.integers(1, 25)),
              max_prefill_chunk=[None, None, 1, 3, 8][int(rng.integers(0, 5))],
              max_queued=[4 * mr, 6, 12][int(rng.integers(0, 3))])
    if rng.random() < 0.2:
        kw["prefix_caching"] = "off"
    else:
        kw["cache_key"] = b"s" * 16
    beams_only = rng.random() < 0.3          # one width, one priority
    width = int(rng.integers(1, seqs + 1))
    requests = []
    for i in range(int(rng.integers(1, 9))):
        prompt = rng.integers(0, V, size=int(rng.integers(1, 12))).tolist()
        if rng.random() < 0.5:
            prompt = list(range(int(rng.integers(1, 9)))) + prompt
        rk = dict(max_new_tokens=int(rng.choice([1, 2, 3, 5, 8])),
                  eos_token_id=[None, 3, 17][int(rng.integers(0, 3))])
        kind = 2 if beams_only else int(rng.integers(0, 3))
        if not beams_only:
            rk["priority"] = int(rng.choice([0, 0, 1, -1]))
        if kind == 1:
            rk["n"] = int(rng.integers(1, 6))
        elif kind == 2:
            rk["beam_width"] = width if beams_only else int(rng.integers(1, 6))
        requests.append((i, prompt, rk))
    return (nb, pt, lp, seqs), kw, requests


@pytest.mark.parametrize("block", range(8))
def test_every_accepted_workload_finishes_within_the_bound(block):
    ran = 0
    for seed in range(block * 2500, (block + 1) * 2500):
        args, kw, requests = workload(seed)
        s, taken, r, bound = run_core(args, kw, requests)
        if r is None:
            continue
        ran += 1
        assert len(r.stats) <= bound
        assert len(r.finished) == len(taken)
    assert ran > 2000


@pytest.mark.parametrize("seed", [108964, 132437, 146218])
def test_workloads_whose_beam_groups_park_finish_within_the_bound(seed):
    """Seeds of ``workload`` (rare among them) where beam groups of one width and priority
    wait for each other's slots and pages and park their beams (two without a cache)."""
    args, kw, requests = workload(seed)
    s, taken, r, bound = run_core(args, kw, requests)
    assert s.parked > 0 and len(r.finished) == len(taken)
    if kw.get("prefix_caching") != "off":
        c, t, _, _, _ = drive_lockstep(args, kw, requests)
        assert not c.has_unfinished() and not t.has_unfinished() and c.parked == t.parked


@pytest.mark.parametrize("block", range(4))
def test_the_twin_finishes_every_accepted_workload_as_the_core_does(block):
    for seed in range(block * 250, (block + 1) * 250):
        args, kw, requests = workload(seed)
        if kw.get("prefix_caching") == "off":
            continue            # the twin models the automatic cache
        c, t, finished, steps, bound = drive_lockstep(args, kw, requests)
        assert not c.has_unfinished() and not t.has_unfinished(), (seed, steps, bound)
        assert c.parked == t.parked and c.forks == t.forks
