"""The plans' fork lists (``fork_child_ids`` / ``fork_parent_ids``), new ids named again after
a discarded plan, and best-first beam rows (docs/DESIGN.md, "The plan",
"Tokens back", "Beam search at the step level"): the compiled core against the pure-Python
twin."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers.ctypes_abi import step_capsule
from helpers.groups import PROMPT
from helpers.step_checks import assert_same_plan, state_snapshot

import qualia
from qualia.twin import StepScheduler as TwinStepScheduler
from qualia.twin.groups import CHILD_BASE

KW = dict(max_num_batched_tokens=64, max_num_seqs=4, max_queued=32, vocab_size=64,
          cache_key=b"f" * 16)


def both(**kw):
    kw = {**KW, **kw}
    return [qualia.StepScheduler(64, 4, 16, **kw), TwinStepScheduler(64, 4, 16, **kw)]


def short_lived_groups(s):
    """Three n groups in four rows: the first two groups' members finish as they take their
    token, so their rows take the third group's children in the same update (five forks)."""
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=1, n=2)
    s.add_request(2, [1, 2, 3, 4, 6], max_new_tokens=1, n=2)
    s.add_request(3, [1, 2, 3, 4, 7], max_new_tokens=2, n=4)
    p = s.schedule()
    s.update(np.full(len(p.logits_indices), 9, np.uint32))


def test_more_forks_than_rows_between_two_plans_are_all_named():
    """One update can fork more children than max_num_seqs (children that finish at once free
    their rows for the next group's): the next plan names every fork, as the twin's does."""
    plans = []
    for s in both():
        short_lived_groups(s)
        plans.append(s.schedule())
    assert_same_plan(*plans)
    assert len(plans[0].fork_child_ids) == 5
    assert plans[0].fork_parent_ids.tolist() == [1, 2, 3, 3, 3]


def test_more_forks_than_rows_survive_a_discard():
    plans = []
    for s in both():
        short_lived_groups(s)
        s.schedule()
        s.discard_plan()
        plans.append(s.schedule())
    assert_same_plan(*plans)
    assert len(plans[0].fork_child_ids) == 5


def test_the_c_abi_plan_carries_more_forks_than_rows():
    """run() with a C backend: num_forks and the two arrays name all five forks."""
    from helpers.ctypes_abi import EXECUTE_STEP

    seen = []

    def execute(ctx, plan, sampled_out, logprobs_out):
        p = plan.contents
        kids = ctypes.cast(p.fork_child_ids, ctypes.POINTER(ctypes.c_uint64))
        pars = ctypes.cast(p.fork_parent_ids, ctypes.POINTER(ctypes.c_uint64))
        seen.append([(kids[i], pars[i]) for i in range(p.num_forks)])
        out = ctypes.cast(sampled_out, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):
            out[r] = 9
        return 0

    cb = EXECUTE_STEP(execute)
    s = qualia.StepScheduler(64, 4, 16, **KW)
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=1, n=2)
    s.add_request(2, [1, 2, 3, 4, 6], max_new_tokens=1, n=2)
    s.add_request(3, [1, 2, 3, 4, 7], max_new_tokens=2, n=4)
    s.run(step_capsule(cb))
    assert [p for _, p in seen[1]] == [1, 2, 3, 3, 3]
    assert len({c for c, _ in seen[1]}) == 5


def test_children_aborted_before_the_next_plan_is_forked_and_finished_after_a_discard():
    plans = []
    for s in both():
        s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=4, n=3)
        p = s.schedule()
        s.update(np.full(len(p.logits_indices), 9, np.uint32))
        p = s.schedule()
        kids = p.fork_child_ids.tolist()
        s.discard_plan()
        s.add_request(2, [1, 2, 3, 4, 6], max_new_tokens=4)
        s.abort(1)                  # the group: its forked children too
        plans.append(s.schedule())
        assert plans[-1].fork_child_ids.tolist() == kids
    assert_same_plan(*plans)
    assert len(plans[0].fork_child_ids) == 2
    assert set(plans[0].fork_child_ids.tolist()) <= set(plans[0].finished_request_ids.tolist())


def test_fork_fallbacks_are_new_not_forks():
    """Children queued for lack of a row are no forks: the plan that admits one names it as
    new; neither plan lists it among the forks (plans compared in lockstep: the core's arrays
    are views the next schedule overwrites)."""
    ss = both(max_num_seqs=3)
    for s in ss:
        s.add_request(9, [7, 7, 7, 7, 7], max_new_tokens=2)
        s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=3, n=3)
        p = s.schedule()
        s.update(np.full(len(p.logits_indices), 9, np.uint32))
    p1 = [s.schedule() for s in ss]     # one child forked, one queued
    assert_same_plan(*p1)
    assert len(p1[0].fork_child_ids) == 1 and [s.fork_fallbacks for s in ss] == [1, 1]
    forked = p1[0].fork_child_ids.tolist()
    for s, p in zip(ss, p1):
        s.update(np.full(len(p.logits_indices), 9, np.uint32))     # 9 finishes
    p2 = [s.schedule() for s in ss]
    assert_same_plan(*p2)
    assert len(p2[0].fork_child_ids) == 0 and len(p2[0].new_request_ids) == 1
    assert int(p2[0].new_request_ids[0]) not in forked


def test_a_discarded_plans_new_id_is_new_again_alike():
    plans = []
    for s in both(max_num_seqs=4):
        s.add_request(1, list(range(1, 9)), max_new_tokens=6)
        p = s.schedule()
        s.update(np.full(len(p.logits_indices), 9, np.uint32))
        s.add_request(2, list(range(20, 28)), max_new_tokens=6, priority=5)
        s.schedule()
        s.discard_plan()           # 2 stays unseen
        p = s.schedule()
        assert 2 in p.new_request_ids.tolist()
        plans.append(p)
    assert_same_plan(*plans)


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [-1.0, -np.inf, -np.inf],
                                 [-np.inf, -np.inf, -np.inf], [-0.0, 0.0, -0.0]])
def test_ties_are_best_first_alike(row):
    plans = []
    for s in both():
        s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=3, beam_width=2)
        p = s.schedule()
        m = len(p.logits_indices)
        k = p.num_topk
        tids = np.tile(np.arange(k, dtype=np.uint32), (m, 1))
        tlps = np.tile(np.array((row * k)[:k], dtype=np.float64), (m, 1))
        s.update(np.zeros(m, np.uint32), tids, tlps)
        plans.append(s.schedule())
    assert_same_plan(*plans)


def test_an_unsorted_row_changes_nothing_alike():
    for s in both():
        s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=3, beam_width=2)
        p = s.schedule()
        m, k = len(p.logits_indices), p.num_topk
        tids = np.tile(np.arange(k, dtype=np.uint32), (m, 1))
        tlps = np.tile(-1.0 - np.arange(k, dtype=np.float64), (m, 1))
        tlps[0, k - 1] = np.nextafter(tlps[0, k - 2], 0.0)
        before = state_snapshot(s) if isinstance(s, qualia.StepScheduler) else None
        with pytest.raises(ValueError, match="best first"):
            s.update(np.zeros(m, np.uint32), tids, tlps)
        if before is not None:
            assert state_snapshot(s) == before


class PlanWith:
    """A Python plan: a core plan's arrays, its fork arrays replaced (None: absent)."""

    def __init__(self, plan, kids, pars):
        for name in dir(plan):
            if not name.startswith("_"):
                setattr(self, name, getattr(plan, name))
        for name, v in (("fork_child_ids", kids), ("fork_parent_ids", pars)):
            if v is None:
                delattr(self, name)
            else:
                setattr(self, name, v)


def fork_seeing_backend(seen):
    from helpers.ctypes_abi import EXECUTE_STEP

    def execute(ctx, plan, sampled_out, logprobs_out):
        p = plan.contents
        kids = ctypes.cast(p.fork_child_ids, ctypes.POINTER(ctypes.c_uint64))
        pars = ctypes.cast(p.fork_parent_ids, ctypes.POINTER(ctypes.c_uint64))
        seen.append([(kids[i], pars[i]) for i in range(p.num_forks)])
        out = ctypes.cast(sampled_out, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):      # every row written, as the ABI asks
            out[r] = 0
        return 0

    cb = EXECUTE_STEP(execute)
    return step_capsule(cb)


def a_plan():
    s = qualia.StepScheduler(64, 4, 16, **KW)
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=3)
    return s.schedule()


U = np.uint64


@pytest.mark.parametrize("kids, pars", [(np.array([1, 2], U), np.array([1], U)),
                                        (np.array([1], U), None), (None, np.array([3], U))])
def test_mismatched_fork_arrays_are_refused_by_the_lowering(kids, pars):
    seen = []
    with pytest.raises(ValueError, match="fork"):
        qualia._core._call_step_backend(fork_seeing_backend(seen),
                                        PlanWith(a_plan(), kids, pars))
    assert seen == []


@pytest.mark.parametrize("kids, pars", [(np.array([5, 6], U), np.array([1, 1], U)),
                                        (np.arange(8, dtype=U)[::2], np.arange(4, dtype=U)),
                                        (None, None), (np.zeros(0, U), np.zeros(0, U))])
def test_python_fork_arrays_reach_the_c_backend_as_given(kids, pars):
    seen = []
    try:
        qualia._core._call_step_backend(fork_seeing_backend(seen),
                                        PlanWith(a_plan(), kids, pars))
    except (ValueError, TypeError):
        assert kids is not None and not kids.flags.c_contiguous    # refused, never misread
        return
    want = [] if kids is None else list(zip(kids.tolist(), pars.tolist()))
    assert seen == [want]


def recording_c_backend(seen, fail_at=None):
    """A C backend sampling token 9 everywhere that records each plan's (forks, new ids) and
    fails (status 7) on call number ``fail_at``."""
    from helpers.ctypes_abi import EXECUTE_STEP

    def execute(ctx, plan, sampled_out, logprobs_out):
        p = plan.contents
        kids = ctypes.cast(p.fork_child_ids, ctypes.POINTER(ctypes.c_uint64))
        pars = ctypes.cast(p.fork_parent_ids, ctypes.POINTER(ctypes.c_uint64))
        new = ctypes.cast(p.new_request_ids, ctypes.POINTER(ctypes.c_uint64))
        seen.append(([(kids[i], pars[i]) for i in range(p.num_forks)],
                     [new[i] for i in range(p.num_new)]))
        if len(seen) == fail_at:
            return 7
        out = ctypes.cast(sampled_out, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):
            out[r] = 9
        return 0

    return step_capsule(EXECUTE_STEP(execute))


def groups(s):
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=1, n=2)
    s.add_request(2, [1, 2, 3, 4, 6], max_new_tokens=1, n=2)
    s.add_request(3, [1, 2, 3, 4, 7], max_new_tokens=3, n=4)
    s.add_request(4, [5, 5, 5, 5, 5, 5, 5, 5, 5], max_new_tokens=2, n=3)


def twin_steps(t):
    steps = []
    while t.has_unfinished():
        p = t.schedule()
        steps.append((list(zip(p.fork_child_ids.tolist(), p.fork_parent_ids.tolist())),
                      p.new_request_ids.tolist()))
        t.update(np.full(len(p.logits_indices), 9, np.uint32))
    return steps


def test_run_with_a_c_backend_hands_over_the_twins_forks_and_new_ids():
    seen = []
    s, t = both()
    groups(s)
    groups(t)
    s.run(recording_c_backend(seen))
    assert seen == twin_steps(t)


def test_a_failed_c_step_names_its_forks_and_new_ids_again():
    """run()'s step fails on its second call (the first with forks): the plan is discarded,
    and the next run's first plan names the same forks and new ids, as the twin's plan after
    discard_plan does."""
    seen = []
    s, t = both()
    groups(s)
    groups(t)
    with pytest.raises(qualia.errors.RaggedBackendError.Failed):
        s.run(recording_c_backend(seen, fail_at=2))
    s.run(recording_c_backend(seen))
    p = t.schedule()
    t.update(np.full(len(p.logits_indices), 9, np.uint32))
    t.schedule()
    t.discard_plan()
    want = twin_steps(t)
    assert seen[1][0] and seen[2] == seen[1]
    assert seen[2:] == want


def lockstep(seed, stats):
    """Random adds (n groups, beams), aborts, schedules, discards and updates on the core and
    the twin side by side; every plan must agree (small pools: preemptions too)."""
    rng = np.random.default_rng(seed)
    seqs = int(rng.integers(2, 6))
    kw = dict(max_num_batched_tokens=int(rng.integers(4, 40)), max_num_seqs=seqs,
              vocab_size=64, cache_key=b"z" * 16, max_queued=24)
    nb = int(rng.integers(8, 40))
    ss = [qualia.StepScheduler(nb, 4, 16, **kw), TwinStepScheduler(nb, 4, 16, **kw)]
    nid = 0
    for _ in range(80):
        a = rng.integers(0, 10)
        if a < 4:
            width = int(rng.integers(1, 3)) if a == 0 else 0
            n = int(rng.integers(1, seqs + 1))
            toks = [1, 2, 3] + rng.integers(0, 64, size=int(rng.integers(1, 6))).tolist()
            mx = int(rng.choice([1, 1, 2, 3, 5]))
            extra = dict(beam_width=width) if width else dict(n=n)
            errs = []
            for s in ss:
                try:
                    s.add_request(nid, toks, max_new_tokens=mx, eos_token_id=3, **extra)
                    errs.append(None)
                except Exception as e:      # noqa: BLE001 -- the same refusal in both
                    errs.append(type(e))
            assert errs[0] == errs[1]
            nid += 1
        elif a < 5 and nid:
            rid = int(rng.integers(0, nid))
            ok = []
            for s in ss:
                try:
                    s.abort(rid)
                    ok.append(True)
                except Exception:           # noqa: BLE001
                    ok.append(False)
            assert ok[0] == ok[1]
        else:
            ps = [s.schedule() for s in ss]
            assert_same_plan(*ps)
            stats.append((len(ps[0].fork_child_ids), seqs))
            if rng.random() < 0.2:
                for s in ss:
                    s.discard_plan()
                continue
            m, k = len(ps[0].logits_indices), ps[0].num_topk
            ids = rng.integers(0, 64, size=m).astype(np.uint32)
            args = [ids]
            if k:
                tids = np.array([rng.permutation(64)[:k] for _ in range(m)], np.uint32)
                tlps = -np.sort(rng.choice([0.0, 0.5, 1.0, np.inf], size=(m, k)), axis=1)
                args += [tids.reshape(m, k), tlps]      # best first, with ties and -inf
            for s in ss:
                s.update(*args)


def test_random_lockstep_fork_lists_agree():
    stats = []
    for seed in range(150):
        lockstep(seed, stats)
    assert any(f > seqs for f, seqs in stats)       # more forks than rows were exercised


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_plans_name_forks_and_a_discarded_plans_admissions(kind):
    """A plan names the forks made since the previous plan (child, parent), and a discarded
    plan's forks and new ids are named again by the next plan; a forked child is not new."""
    kw = dict(max_num_batched_tokens=64)
    s = (qualia.StepScheduler(64, 4, 16, 8, **kw) if kind == "core"
         else TwinStepScheduler(64, 4, 16, 8, **kw))
    s.add_request(7, PROMPT, max_new_tokens=4, n=3)
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == [7] and plan.fork_child_ids.tolist() == []
    s.discard_plan()
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == [7]          # the discarded plan's, named again
    s.update(np.arange(len(plan.sampled_request_ids), dtype=np.uint32) + 11)
    children = [m for m in s.group_members(7) if m != 7]
    assert len(children) == 2
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == []
    assert plan.fork_child_ids.tolist() == children
    assert plan.fork_parent_ids.tolist() == [7, 7]
    assert plan.fork_child_ids.dtype == plan.fork_parent_ids.dtype == np.uint64
    s.discard_plan()
    plan = s.schedule()
    assert plan.fork_child_ids.tolist() == children      # named again after the discard
    s.update(np.full(len(plan.sampled_request_ids), 12, dtype=np.uint32))
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == [] and plan.fork_child_ids.tolist() == []


def test_the_c_abi_plan_carries_the_forks():
    """run() hands the forks to a C step backend in the plan struct (num_forks, fork_child_ids,
    fork_parent_ids), as the Python plan names them."""
    import ctypes

    from helpers.ctypes_abi import EXECUTE_STEP, step_capsule

    seen = []

    def execute(ctx, plan, sampled_out, logprobs_out):
        p = plan.contents
        kids = ctypes.cast(p.fork_child_ids, ctypes.POINTER(ctypes.c_uint64))
        pars = ctypes.cast(p.fork_parent_ids, ctypes.POINTER(ctypes.c_uint64))
        seen.append([(kids[i], pars[i]) for i in range(p.num_forks)])
        out = ctypes.cast(sampled_out, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):
            out[r] = 20 + r
        return 0

    cb = EXECUTE_STEP(execute)
    s = qualia.StepScheduler(64, 4, 16, 8, max_num_batched_tokens=64)
    s.add_request(7, PROMPT, max_new_tokens=2, n=3)
    s.run(step_capsule(cb))
    kids = sorted(c for step in seen for c, _ in step)
    assert seen[0] == [] and len(seen[1]) == 2 and all(p == 7 for _, p in seen[1])
    assert len(kids) == 2 and all(k >= CHILD_BASE for k in kids)
    assert all(step == [] for step in seen[2:])
