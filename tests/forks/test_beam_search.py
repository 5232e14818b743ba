"""Beam groups in the compiled engine step (docs/DESIGN.md, "Beam search at the step level"): the
search equals the dense beam search and the twin (stop ids, preemption and parking, the C run
loop, the example backends), and the checks around it: malformed candidates from ``update`` and
from Python and C backends, aborts at every phase of a group, discards, tiny pools, ids of
internal children, re-entrant user code, and the memory rules (no leak, no allocation per step).
Every refused call changes nothing; where the twin (``qualia.twin.StepScheduler``) models the
case, the core and the twin agree call for call.
"""

from __future__ import annotations

import ctypes
import gc
import random
from itertools import repeat

import numpy as np
import pytest
from helpers.ctypes_abi import EXECUTE_STEP, CStepBackend
from helpers.groups import (
    DENSE,
    GOOD,
    HB,
    HOT,
    PROMPT,
    V,
    W,
    all_pages_back,
    beam_plan,
    both,
    drain,
    execute,
    lockstep,
    state,
    step,
)
from helpers.memory import ROUNDS, SLACK, assert_no_growth_per_step, measure, probe
from helpers.step_checks import assert_same_plan, example_rule, example_topk_rule
from helpers.step_machine import finished_key

import qualia
from qualia.errors import BusyError, StepError
from qualia.model import PagedModelBackend
from qualia.sim.adapters import PlanModelSteps
from qualia.twin import StepScheduler as TwinStepScheduler
from qualia.twin.groups import CHILD_BASE

# -- 1. candidates: values that would make the selection silently wrong -------------------------

class Sub(np.ndarray):
    """A numpy subclass (np.array(x) of it is a plain copy)."""


@pytest.mark.parametrize("bad", ["nan", "+inf", "nan_in_plain_row", "bool", "strings", "complex",
                                 "objects", "repeat", "repeat_last"])
def test_candidates_that_would_leave_scores_unordered_or_beams_equal_are_refused(bad):
    """NaN or +inf log-probabilities (in any row), non-real log-probability arrays and a token
    named twice among a beam row's candidates raise ValueError with nothing applied, in the
    core and the twin; the same update with good candidates then agrees."""
    c, t, plan = beam_plan()
    ids, tids, tlps = HB.execute_step_topk(plan)
    tids, tlps = tids.astype(np.int64), tlps.astype(np.float64)
    row = 0 if plan.sampled_request_ids[0] == 1 else 1      # the beam row
    bt, bl = tids.copy(), tlps.copy()
    if bad == "nan":
        bl[row, 1] = np.nan
    elif bad == "+inf":
        bl[row, 0] = np.inf
    elif bad == "nan_in_plain_row":
        bl[1 - row, 2] = np.nan
    elif bad == "bool":
        bl = bl < -1
    elif bad == "strings":
        bl = bl.astype(str)
    elif bad == "complex":
        bl = bl + 0j
    elif bad == "objects":
        bl = bl.astype(object)
    elif bad == "repeat":
        bt[row, 2] = bt[row, 0]
    else:
        bt[row, 2] = bt[row, 1]
    before = state(c, [1]), state(t, [1])
    for s in (c, t):
        with pytest.raises(ValueError):
            s.update(ids, bt, bl)
    assert (state(c, [1]), state(t, [1])) == before
    assert finished_key(c.update(ids, tids, tlps)) == finished_key(t.update(ids, tids, tlps))
    assert state(c, [1]) == state(t, [1])
    lockstep(c, t)


def test_minus_inf_and_a_repeat_past_a_narrower_beams_width_are_accepted():
    """-inf is a token of probability 0 (its beam sorts last); a plan's num_topk is its widest
    group's, and a narrower group reads only its first w candidates, so a repeat past them is
    not an error."""
    c, t = both(64, 4, 16, 8)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
        s.add_request(2, PROMPT[2:], max_new_tokens=3, beam_width=4)
    pc = c.schedule()
    assert_same_plan(pc, t.schedule())
    assert pc.num_topk == 4
    ids, tids, tlps = HB.execute_step_topk(pc)
    tlps = tlps.astype(np.float64)
    narrow = pc.sampled_request_ids.tolist().index(1)
    tids[narrow, 3] = tids[narrow, 0]
    tlps[narrow, 1:] = -np.inf   # best first still: -inf sorts last
    assert finished_key(c.update(ids, tids, tlps)) == finished_key(t.update(ids, tids, tlps))
    assert c.group_members(1) == t.group_members(1) and len(c.group_members(1)) == 2
    fc = lockstep(c, t)
    assert {f.request_id for f in fc} == {1, 2}


@pytest.mark.parametrize("shape", ["transposed", "fortran", "non_contiguous", "float32",
                                   "float16", "int_logprobs", "subclass", "uint64_ids"])
def test_candidate_arrays_of_any_layout_and_real_dtype_equal_the_plain_ones(shape):
    """Layout and numeric dtype do not change the result: the same values give the same
    selection as plain C-ordered int64 / float64 arrays."""
    runs = []
    for variant in ("plain", shape):
        c, _, plan = beam_plan()
        ids, tids, tlps = HB.execute_step_topk(plan)
        tlps = np.floor(tlps.astype(np.float64) * 8)       # exact in every dtype below
        tids = tids.astype(np.int64)
        if variant == "transposed":
            tids, tlps = np.ascontiguousarray(tids.T).T, np.ascontiguousarray(tlps.T).T
        elif variant == "fortran":
            tids, tlps = np.asfortranarray(tids), np.asfortranarray(tlps)
        elif variant == "non_contiguous":
            tids = np.repeat(tids, 2, axis=1)[:, ::2]
            tlps = np.repeat(tlps, 2, axis=1)[:, ::2]
        elif variant in ("float32", "float16"):
            tlps = tlps.astype(variant)
        elif variant == "int_logprobs":
            tlps = tlps.astype(np.int64)
        elif variant == "subclass":
            tids, tlps = tids.view(Sub), tlps.view(Sub)
        elif variant == "uint64_ids":
            tids = tids.astype(np.uint64)
        assert variant == "plain" or not (tids.flags.c_contiguous and tids.dtype == np.int64
                                          and tlps.flags.c_contiguous
                                          and tlps.dtype == np.float64
                                          and type(tids) is np.ndarray)
        c.update(ids, tids, tlps)
        runs.append((state(c, [1]), finished_key(drain(c))))
    assert runs[0] == runs[1]


# -- 2. run() with backends that return garbage ---------------------------------------------------

_KEEP = []


def c_backend(fill, flags=2):
    """A C step backend over a ctypes callback: samples token 5 and writes candidates
    fill(row, j) -> (id, log-probability)."""
    def ex(ctx, plan, sampled, logprobs):
        p = plan.contents
        out = ctypes.cast(sampled, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):
            out[r] = 5
        if p.num_topk:
            ti = ctypes.cast(p.topk_ids_out, ctypes.POINTER(ctypes.c_uint32))
            tl = ctypes.cast(p.topk_logprobs_out, ctypes.POINTER(ctypes.c_float))
            for r in range(p.num_sampled):
                for j in range(p.num_topk):
                    ti[r * p.num_topk + j], tl[r * p.num_topk + j] = fill(r, j)
        return 0
    execute_step = EXECUTE_STEP(ex)
    iface = CStepBackend(qualia.STEP_ABI_VERSION, ctypes.sizeof(CStepBackend), flags, 0, None,
                         ctypes.cast(execute_step, ctypes.c_void_p), None)
    name = qualia.STEP_CAPSULE_NAME.encode()
    _KEEP.append((iface, execute_step, name))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(iface), name, None)


@pytest.mark.parametrize("fill,match", [
    (lambda r, j: (GOOD(r, j)[0], float("nan")), "NaN or .*above 0"),
    (lambda r, j: (GOOD(r, j)[0], float("inf") if j == 1 else -1.0), "NaN or .*above 0"),
    (lambda r, j: (4, -1.0 * j), "repeated a token"),
    (lambda r, j: (GOOD(r, j)[0], 0.5 * j - 3.0), "not best first"),
    (lambda r, j: (V + j, -1.0 * j), "outside"),
    (lambda r, j: (2**32 - 1, -1.0), "outside"),
])
def test_a_c_backend_writing_garbage_candidates_fails_its_step_applying_nothing(fill, match):
    """The step is discarded: the scheduler is as schedule() + discard_plan() leave it (the
    admissions stay, no token, fork or selection applied), and a good backend then finishes
    the group as from a fresh start."""
    c = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    ref = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    for s in (c, ref):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
        s.add_request(2, PROMPT[:3], max_new_tokens=2)
    ref.schedule()
    ref.discard_plan()
    with pytest.raises(ValueError, match=match) as info:
        c.run(c_backend(fill))
    assert info.value.finished == []
    assert state(c, [1]) == state(ref, [1])
    assert finished_key(c.run(c_backend(GOOD)).finished) == \
        finished_key(ref.run(c_backend(GOOD)).finished)
    all_pages_back(c)


def test_a_c_backend_without_the_flag_is_refused_even_with_a_beam_group_added_later():
    # a beam group queued after a run() that had none: the next run() refuses before any step
    c = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    c.add_request(2, PROMPT[:3], max_new_tokens=2)
    assert len(c.run(c_backend(GOOD, flags=0)).finished) == 1
    c.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    before = state(c, [1])
    with pytest.raises(TypeError, match="QUALIA_STEP_WRITES_TOPK"):
        c.run(c_backend(GOOD, flags=0))
    assert state(c, [1]) == before
    assert len(c.run(c_backend(GOOD)).finished) == 1
    all_pages_back(c)


class TupleThatRaises(tuple):
    def __iter__(self):
        raise RuntimeError("unpacking runs user code")


@pytest.mark.parametrize("shape,exc", [
    (lambda p: (HB.execute_step(p),), ValueError),
    (lambda p: HB.execute_step_topk(p)[:2], ValueError),
    (lambda p: HB.execute_step_topk(p) + (None,), ValueError),
    (lambda p: None, TypeError),
    (lambda p: list(HB.execute_step_topk(p)), TypeError),
    (lambda p: TupleThatRaises(HB.execute_step_topk(p)), RuntimeError),
    (lambda p: (lambda a: (a[0], a[2], a[1]))(HB.execute_step_topk(p)), ValueError),
    (lambda p: HB.execute_step(p), ValueError),
    (lambda p: (lambda a: (a[0], a[1], np.full(a[2].shape, np.nan)))(HB.execute_step_topk(p)),
     ValueError),
])
def test_a_python_backend_returning_malformed_tuples_fails_its_step_applying_nothing(shape, exc):
    c = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    ref = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    for s in (c, ref):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
    ref.schedule()
    ref.discard_plan()

    class Backend:
        def execute_step(self, plan):
            return shape(plan)
    with pytest.raises(exc):
        c.run(Backend())
    assert state(c, [1]) == state(ref, [1])

    class Good:
        def execute_step(self, plan):
            return execute(plan)
    assert finished_key(c.run(Good()).finished) == finished_key(ref.run(Good()).finished)


# -- 3. without a prefix cache, parked beams recompute their prompts -------------------------------

def test_beams_without_a_prefix_cache_need_their_whole_sequences_side_by_side():
    """prefix_caching='off': a parked or queued beam recomputes its prompt into pages of its
    own, so a group whose beams fit only by sharing the prompt would park forever (run() never
    returned).  Such a group is NeverFits; one that fits whole runs to its end."""
    def go(num_blocks):
        c = qualia.StepScheduler(num_blocks, 4, 16, 2, prefix_caching="off", vocab_size=V,
                                 max_queued=16)
        c.add_request(2, [7, 7], max_new_tokens=3)         # holds a row: the child is queued
        c.add_request(1, list(range(8)), max_new_tokens=4, beam_width=2)
        return c
    for nb in (4, 5):       # 2 shared + 2 x 1 tail pages, but 2 x 3 pages once parked
        with pytest.raises(StepError.NeverFits, match="2 beams need 6 pages"):
            go(nb)
    c = go(6)
    r = c.run(HB, max_steps=200)
    assert not c.has_unfinished() and len(r.finished) == 2 and c.fork_fallbacks > 0
    assert c.free_pages == c.num_pages
    # with the cache, sharing the prompt is enough
    a = qualia.StepScheduler(4, 4, 16, 2, vocab_size=V, max_queued=16)
    a.add_request(1, list(range(8)), max_new_tokens=4, beam_width=2)
    assert len(a.run(HB, max_steps=200).finished) == 1


# -- 4. aborts at every phase, discards, edges -------------------------------------------------

def phases():
    """(name, steps to run before aborting, whether a plan is pending at the abort)."""
    return [("queued", 0, False), ("in_prefill_plan", 0, True), ("mid_prefill", 1, False),
            ("beam_waits_for_sibling", 3, False), ("parked", 5, False),
            ("fewer_live_beams", 6, False), ("in_decode_plan", 8, True),
            ("after_result", 10, False)]


@pytest.mark.parametrize("name,steps,pending", phases())
def test_aborting_a_beam_group_at_each_phase_equals_the_twin_and_frees_everything(name, steps,
                                                                                    pending):
    kw = dict(max_num_batched_tokens=6, max_num_seqs=3, max_prefill_chunk=4, max_queued=24)
    c, t = both(12, 2, 12, **kw)
    for s in (c, t):
        s.add_request(1, PROMPT[:7], max_new_tokens=5, beam_width=3, eos_token_id=17)
        s.add_request(2, PROMPT[:4], max_new_tokens=5, n=2, priority=1)
        s.add_request(3, PROMPT[3:], max_new_tokens=4, beam_width=2)
    for _ in range(steps):
        pc, pt = c.schedule(), t.schedule()
        assert_same_plan(pc, pt)
        assert finished_key(c.update(*execute(pc))) == finished_key(t.update(*execute(pt)))
    if pending:
        pc, pt = c.schedule(), t.schedule()
        assert_same_plan(pc, pt)
    assert state(c, [1, 3]) == state(t, [1, 3])
    live = state(c, [1])[6][1]
    assert (live is None) == (name == "after_result")
    if name == "beam_waits_for_sibling":
        assert c.fork_fallbacks > 0 and c.num_waiting > 1
    if name == "parked":
        assert c.parked > 0 and c.num_running == 0
    if name == "fewer_live_beams":
        assert len(live) < 3                # a beam ended (a hypothesis or dropped)
    for s in (c, t):
        if name != "after_result":
            s.abort(1)
        with pytest.raises(StepError.UnknownRequest):
            s.abort(1)
        with pytest.raises(StepError.UnknownRequest):
            s.group_members(1)
    assert state(c, [1, 3]) == state(t, [1, 3])
    if pending and name == "in_prefill_plan":
        # the pending plan is applied without the group (its rows are skipped)
        assert finished_key(c.update(*execute(pc))) == finished_key(t.update(*execute(pt)))
    elif pending:
        for s in (c, t):
            s.discard_plan()
    assert state(c, [1, 3]) == state(t, [1, 3])
    lockstep(c, t)
    all_pages_back(c)
    # the group's entries are back: the queue takes max_queued plain requests again
    for k in range(c.max_queued):
        c.add_request(100 + k, [1], max_new_tokens=1)


def test_an_aborted_groups_rows_in_the_pending_plan_are_skipped_and_its_id_reusable():
    """Abort a beam group whose beams are in the pending plan, add a new beam group under the
    same id, then apply the plan (candidates for the dead rows are not read)."""
    c, t = both(64, 4, 16, 6, max_queued=32)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=4, beam_width=3)
    for _ in range(2):
        pc, pt = c.schedule(), t.schedule()
        c.update(*execute(pc))
        t.update(*execute(pt))
    pc, pt = c.schedule(), t.schedule()
    assert pc.num_topk == 3 and len(pc.logits_indices) == 3
    ids, tids, tlps = execute(pc)
    tids[:, 1] = tids[:, 0]                 # repeats in dead rows are not read
    for s in (c, t):
        s.abort(1)
        s.add_request(1, PROMPT[:5], max_new_tokens=3, beam_width=4)
    assert finished_key(c.update(ids, tids, tlps)) == finished_key(t.update(ids, tids, tlps))
    assert state(c, [1]) == state(t, [1])
    lockstep(c, t)
    all_pages_back(c)


def test_discarding_beam_plans_repeats_them_and_equals_the_twin():
    c, t = both(24, 2, 16, 4, max_num_batched_tokens=8, max_queued=32)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=5, beam_width=4, stop_token_ids=[9])
        s.add_request(2, PROMPT[:5], max_new_tokens=3, beam_width=2)
    k = 0
    while c.has_unfinished():
        pc, pt = c.schedule(), t.schedule()
        assert_same_plan(pc, pt)
        k += 1
        if k % 3 == 0:
            for s in (c, t):
                s.discard_plan()
            again = c.schedule()
            assert_same_plan(again, t.schedule())
            assert again.sampled_request_ids.tolist() == pc.sampled_request_ids.tolist()
            pc = again
            pt = t._plan
        assert finished_key(c.update(*execute(pc))) == finished_key(t.update(*execute(pt)))
        assert state(c, [1, 2]) == state(t, [1, 2])
    assert not t.has_unfinished()
    all_pages_back(c)


@pytest.mark.parametrize("width,max_new,stops", [(4, 1, False), (4, 3, True), (1, 4, False),
                                                  (4, 4, False)])
def test_edges_width_equal_to_max_num_seqs_one_token_and_all_stop_candidates(width, max_new,
                                                                            stops):
    """beam_width == max_num_seqs with a queue of exactly w entries; max_new_tokens=1 (every
    candidate a hypothesis at the prompt's row); every token a stop token (the same); width 1
    (greedy)."""
    vocab = 16
    hb = qualia.HashBackend(vocab=vocab)
    c, t = both(64, 4, 16, width, max_queued=width, vocab_size=vocab)
    for s in (c, t):
        s.add_request(1, [p % vocab for p in PROMPT], max_new_tokens=max_new, beam_width=width,
                      stop_token_ids=list(range(vocab)) if stops else [])
        with pytest.raises(StepError.QueueFull):
            s.add_request(2, [1], max_new_tokens=1)
    fc = lockstep(c, t, hb=hb)
    g = fc[0]
    assert len(g.outputs) == width and g.scores == sorted(g.scores, reverse=True)
    if max_new == 1 or stops:
        assert all(len(o) == 1 for o in g.outputs) and c.forks == 0
        assert set(g.finish_reasons) == {"stop" if stops else "length"}
    all_pages_back(c)
    for k in range(width):
        c.add_request(10 + k, [1], max_new_tokens=1)


def test_children_skip_user_ids_at_the_child_base():
    c, t = both(64, 4, 16, 8, max_queued=12)
    base = CHILD_BASE
    for s in (c, t):
        s.add_request(base, [1, 2], max_new_tokens=9)
        s.add_request(base + 2, [1, 2], max_new_tokens=9)
        s.add_request(1, PROMPT, max_new_tokens=4, beam_width=4)
    pc, pt = c.schedule(), t.schedule()
    c.update(*execute(pc))
    t.update(*execute(pt))
    members = c.group_members(1)
    assert members == t.group_members(1)
    assert base not in members and base + 2 not in members and len(set(members)) == 4
    for m in members[1:]:
        with pytest.raises(StepError.DuplicateRequest):
            c.add_request(m, [1], max_new_tokens=1)
        with pytest.raises(StepError.UnknownRequest):
            c.abort(m)                      # a beam alone
    lockstep(c, t)
    all_pages_back(c)



def test_a_child_never_takes_an_id_its_own_update_reports_finished():
    """A request at the child base finishes in the update whose beam selection forks: the
    child skips its id (still taken until that update returns), in the core and the twin."""
    c, t = both(64, 4, 16, 8, max_queued=12)
    for s in (c, t):
        s.add_request(CHILD_BASE, [1, 2], max_new_tokens=1)
        s.add_request(1, PROMPT, max_new_tokens=4, beam_width=2)
    pc, pt = c.schedule(), t.schedule()
    assert sorted(pc.sampled_request_ids.tolist()) == [1, CHILD_BASE]
    fc, ft = c.update(*execute(pc)), t.update(*execute(pt))
    assert [f.request_id for f in fc] == [f.request_id for f in ft] == [CHILD_BASE]
    assert c.group_members(1) == t.group_members(1) == [1, CHILD_BASE + 1]
    lockstep(c, t)
    all_pages_back(c)


def test_a_child_never_takes_the_id_of_a_request_aborted_in_the_pending_plan():
    """A request at the child base is aborted while the plan holding it is pending: its pages
    stay with it, under its id, until the plan is retired, so the beam child that update forks
    skips that id; the group finishes and every page comes back, in the core and the twin."""
    c, t = both(64, 4, 16, 4, max_num_batched_tokens=64, max_queued=12)
    for s in (c, t):
        s.add_request(CHILD_BASE, [1, 2, 3], max_new_tokens=5)
        s.add_request(1, PROMPT, max_new_tokens=4, beam_width=2)
    pc, pt = c.schedule(), t.schedule()
    assert sorted(pc.sampled_request_ids.tolist()) == [1, CHILD_BASE]
    for s in (c, t):
        s.abort(CHILD_BASE)
    c.update(*execute(pc))
    t.update(*execute(pt))
    assert c.group_members(1) == t.group_members(1) == [1, CHILD_BASE + 1]
    fc = lockstep(c, t)
    assert [f.request_id for f in fc] == [1]
    all_pages_back(c)


def test_a_child_never_takes_an_id_the_next_plan_reports_finished():
    """A waiting request at the child base is aborted while a plan is pending: its id goes to
    the next plan's finished ids, which a backend applies after that plan's forks, so the beam
    child forked by the update skips it (core and twin)."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=10)
    c, t = both(64, 4, 16, **kw)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=4, beam_width=2)
        s.add_request(CHILD_BASE, [1, 2, 3], max_new_tokens=5)     # waits: the budget is spent
    pc, pt = c.schedule(), t.schedule()
    assert CHILD_BASE not in pc.request_ids.tolist()
    for s in (c, t):
        s.abort(CHILD_BASE)
    c.update(*execute(pc))
    t.update(*execute(pt))
    assert c.group_members(1) == t.group_members(1) == [1, CHILD_BASE + 1]
    pc, pt = c.schedule(), t.schedule()
    assert_same_plan(pc, pt)
    assert pc.finished_request_ids.tolist() == [CHILD_BASE]
    assert set(pc.fork_child_ids.tolist()).isdisjoint(pc.finished_request_ids.tolist())
    c.update(*execute(pc))
    t.update(*execute(pt))
    lockstep(c, t)
    all_pages_back(c)


def test_an_id_re_added_as_a_beam_group_while_the_plan_is_pending_names_no_row_of_it():
    """An n group's child id has a sampled row in the pending plan; the group is aborted and
    the id added again as a beam group before update: that row belongs to the aborted group,
    not to the new beam, so its candidates are not checked as a beam's (core and twin)."""
    c, t = both(64, 4, 16, 8)
    for s in (c, t):
        s.add_request(7, PROMPT, max_new_tokens=4, beam_width=2)
        s.add_request(1, PROMPT + [7], max_new_tokens=4, n=2)
    pc, pt = c.schedule(), t.schedule()
    assert pc.sampled_request_ids.tolist() == [7, 1, CHILD_BASE]
    oc, ot = execute(pc), execute(pt)
    for s in (c, t):
        s.abort(1)
        s.add_request(CHILD_BASE, [5, 5, 5], max_new_tokens=4, beam_width=3)
    assert c.update(*oc) == t.update(*ot) == []
    lockstep(c, t)
    all_pages_back(c)


def test_child_ids_in_the_c_run_loop_do_not_depend_on_when_it_collects():
    """run(HashBackend()) collects finished requests once per slice of steps, but an id is
    free again when the update that finished it ends: one run() call, a call per step and the
    twin fork the same children (the backend's candidates follow the ids)."""
    hb = qualia.HashBackend(vocab=64)
    kw = dict(max_num_batched_tokens=8, max_num_seqs=4, max_prefill_chunk=3, max_queued=16)
    a, b = qualia.StepScheduler(40, 4, 16, **kw), qualia.StepScheduler(40, 4, 16, **kw)
    t = TwinStepScheduler(40, 4, 16, **kw)
    for s in (a, b, t):
        s.add_request(CHILD_BASE, [1, 2], max_new_tokens=1)
        s.add_request(1, PROMPT, max_new_tokens=5, beam_width=3)
    one = a.run(hb).finished
    per_step = []
    while b.has_unfinished():
        per_step += b.run(hb, max_steps=1).finished

    class Py:
        def execute_step(self, plan):
            return hb.execute_step_topk(plan) if plan.num_topk else hb.execute_step(plan)
    assert finished_key(one) == finished_key(per_step) == finished_key(t.run(Py()).finished)
    assert a.forks == b.forks == t.forks > 0

# -- 5. user code around update ---------------------------------------------------------------

class ArrayLike:
    """An object whose __array__ runs `hook` (user code, resolved before the scheduler is
    owned)."""

    def __init__(self, a, hook):
        self.a, self.hook = a, hook

    def __array__(self, dtype=None, copy=None):
        self.hook()
        return self.a if dtype is None else self.a.astype(dtype)


@pytest.mark.parametrize("what", ["abort", "add", "update", "discard", "raise"])
def test_array_hooks_that_touch_the_scheduler_run_before_it_is_owned(what):
    c, t = both(64, 4, 16, 6, max_queued=32)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
        s.add_request(2, PROMPT[:3], max_new_tokens=3)
    pc = c.schedule()
    assert_same_plan(pc, t.schedule())
    ids, tids, tlps = execute(pc)

    def hook_for(s):
        def hook():
            if what == "abort":
                s.abort(1)
            elif what == "add":
                s.add_request(3, PROMPT, max_new_tokens=2, beam_width=2)
            elif what == "update":
                s.update(ids, tids, tlps)
            elif what == "discard":
                s.discard_plan()
            else:
                raise RuntimeError("hook")
        return hook
    out = []
    for s in (c, t):
        try:
            out.append(finished_key(s.update(ids, ArrayLike(tids, hook_for(s)), tlps)))
        except (StepError.NoPlan, RuntimeError) as exc:
            out.append(type(exc))
    assert out[0] == out[1]
    assert state(c, [1, 3]) == state(t, [1, 3])
    if c.has_unfinished():
        for s in (c, t):
            s.discard_plan()
        lockstep(c, t)
    all_pages_back(c)


def test_gc_callbacks_during_beam_updates_and_runs_get_busy_error():
    """A GC callback that aborts, adds or discards while update() or run() owns the scheduler
    gets BusyError; whatever ran outside the owned sections leaves a consistent scheduler."""
    c = qualia.StepScheduler(64, 4, 16, 6, vocab_size=V, max_queued=32)
    c.add_request(1, PROMPT, max_new_tokens=6, beam_width=3)
    c.add_request(2, PROMPT[:3], max_new_tokens=6, beam_width=2)
    seen = []

    def callback(phase, info):
        if phase != "start":
            return
        for call in (lambda: c.abort(1), c.discard_plan,
                     lambda: c.add_request(9, [1], max_new_tokens=1, beam_width=2)):
            try:
                call()
                seen.append("ran")
            except BusyError:
                seen.append("busy")
            except StepError:
                seen.append("refused")
    old = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1, 1, 1)
    try:
        for _ in range(4):
            try:
                plan = c.schedule()
                c.update(*execute(plan))
            except StepError:
                pass
        c.run(HB, max_steps=3)
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*old)
    assert "busy" in seen
    c.discard_plan()
    drain(c)
    all_pages_back(c)


# -- 6. memory ---------------------------------------------------------------------------------

def test_beam_groups_leak_nothing_across_full_runs_and_aborts():
    c = qualia.StepScheduler(64, 4, 16, 4, vocab_size=V, max_queued=32)

    def cycle(i):
        c.add_request(1, PROMPT, max_new_tokens=4, beam_width=3, namespace=b"ns%d" % (i % 3))
        c.add_request(2, PROMPT[:5], max_new_tokens=3, beam_width=2, namespace=b"xy")
        for _ in range(i % 5):
            step(c)
        if i % 2:
            c.schedule()
        for g in (1, 2):
            try:
                c.abort(g)
            except StepError.UnknownRequest:
                pass
        c.discard_plan()
        drain(c)
    traced, _ = measure(cycle, cycles=2000, warmup=100)
    assert traced <= SLACK, f"{traced} B traced growth over 2000 cycles"


def beams_decoding(groups=8, width=4):
    """groups beam groups decoding with room for many more steps (each step selects, forks
    children and stops beams: the steady state of beam search)."""
    steps = 8 * ROUNDS
    lp = (64 + steps) // 16 + 2
    n = groups * width
    s = qualia.StepScheduler(n * lp, 16, lp, n, max_num_batched_tokens=groups * 128, max_queued=n,
                             cache_key=b"a" * 16, vocab_size=1000)
    for i in range(groups):
        s.add_request(i, np.arange(64, dtype=np.uint32) + i, max_new_tokens=steps,
                      beam_width=width)
    s.run(qualia.HashBackend(vocab=1000), max_steps=3)
    assert s.num_running == n
    return s


def test_the_steady_beam_step_allocates_nothing_in_run_and_by_hand():
    """run(HashBackend) with beam groups (selection, forks, candidates checked) keeps no
    allocation per step, and neither does schedule + update with candidate arrays."""
    hb = qualia.HashBackend(vocab=1000)
    s = beams_decoding()
    forks = s.forks

    def go(k, run=s.run, hb=hb):
        for _ in repeat(None, k):
            run(hb, max_steps=1)
    assert_no_growth_per_step(probe(go), "Scheduler.run with beam groups")
    assert s.forks > forks and s.num_running == 32
    h = beams_decoding()
    ids, tids, tlps = hb.execute_step_topk(h.schedule())
    h.discard_plan()

    def by_hand(k, sched=h.schedule, upd=h.update, ids=ids, tids=tids, tlps=tlps):
        for _ in repeat(None, k):
            sched()
            upd(ids, tids, tlps)
    assert_no_growth_per_step(probe(by_hand), "schedule + update with beam groups")


def test_a_beam_wider_than_the_vocabulary_is_refused():
    """w continuations of a beam are w distinct tokens: beam_width past vocab_size could never
    get valid candidates (every update would fail), so add_request refuses it."""
    c, t = both(64, 4, 16, 4, vocab_size=3)
    for s in (c, t):
        with pytest.raises(ValueError, match="vocab_size=3"):
            s.add_request(1, [1, 2], max_new_tokens=2, beam_width=4)
        assert not s.has_unfinished()
        s.add_request(1, [1, 2], max_new_tokens=2, beam_width=3)
    assert len(lockstep(c, t, hb=qualia.HashBackend(vocab=3))[0].outputs) == 3
    # the hash backend refuses to write more candidates than it has tokens
    u = qualia.StepScheduler(64, 4, 16, 4)
    u.add_request(1, [1, 2], max_new_tokens=2, beam_width=4)
    with pytest.raises(ValueError, match="exceeds the backend's vocabulary"):
        qualia.HashBackend(vocab=3).execute_step_topk(u.schedule())
    u.discard_plan()
    with pytest.raises(ValueError, match="repeated a token"):
        u.run(qualia.HashBackend(vocab=3))
    assert u.run(qualia.HashBackend(vocab=4)).finished[0].request_id == 1


def test_a_c_backend_that_declares_candidates_but_leaves_them_unwritten_fails_its_step():
    """The candidate log-probabilities start NaN before each call: a backend that writes only
    the ids (or nothing) fails the step instead of reusing the previous step's candidates."""
    c = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    c.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
    calls = []

    def fill(r, j):
        calls.append(1)
        return GOOD(r, j)
    c.run(c_backend(fill), max_steps=1)     # a good first step: the buffers hold candidates
    members = c.group_members(1)
    assert len(members) == 3 and calls
    c.schedule()
    c.discard_plan()                        # what a failed step leaves (pages reserved)
    before = state(c, [1])

    def ex(ctx, plan, sampled, logprobs):
        p = plan.contents
        out = ctypes.cast(sampled, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):
            out[r] = 5
        return 0                            # candidates left as they were
    execute_step = EXECUTE_STEP(ex)
    iface = CStepBackend(qualia.STEP_ABI_VERSION, ctypes.sizeof(CStepBackend), 2, 0, None,
                         ctypes.cast(execute_step, ctypes.c_void_p), None)
    name = qualia.STEP_CAPSULE_NAME.encode()
    _KEEP.append((iface, execute_step, name))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    with pytest.raises(ValueError, match="left it unwritten"):
        c.run(new(ctypes.addressof(iface), name, None))
    assert state(c, [1]) == before
    assert len(c.run(c_backend(GOOD)).finished) == 1
    all_pages_back(c)


class CoreBeamBackend:
    """execute_step for qualia.StepScheduler over the paged numpy model, with candidates for beam
    rows (``(ids, topk_ids, topk_logprobs)`` when ``plan.num_topk > 0``)."""

    def __init__(self, num_blocks, page_tokens, sampling=HOT):
        self.b = PlanModelSteps(PagedModelBackend(W, num_blocks, page_tokens, sampling=sampling))

    def execute_step(self, plan):
        return self.b.execute_step(plan)


def dense_beams(prompt, width, new, **kw):
    return [(h.tokens, h.logprob) for h in DENSE.beam_search(prompt, width, new, **kw)]


def beams_of(g):
    return [(o.tolist(), sc) for o, sc in zip(g.outputs, g.scores)]


def drive(s, backend):
    """schedule -> execute -> update by hand; returns the finished records and the plans'
    num_topk."""
    finished, topk = [], []
    while s.has_unfinished():
        plan = s.schedule()
        topk.append(plan.num_topk)
        out = backend.execute_step(plan)
        finished += s.update(*out) if isinstance(out, tuple) else s.update(out)
    return finished, topk


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("eos", [None, 17])
@pytest.mark.parametrize("budget,seqs", [(2048, 8), (5, 4)])
def test_beam_search_equals_the_dense_beam_search_and_the_twin(width, eos, budget, seqs):
    """The core's beam group, driven by hand beside an n group and a plain request, returns the
    dense beam search's hypotheses and scores, best first; the twin gives the same plans and
    results."""
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_queued=32)
    c = qualia.StepScheduler(64, 4, 16, **kw)
    t = TwinStepScheduler(64, 4, 16, **kw)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=6, beam_width=width, eos_token_id=eos)
        s.add_request(2, PROMPT[:4], max_new_tokens=5, n=2)
        s.add_request(3, PROMPT[2:], max_new_tokens=3)
    fc, kc = drive(c, CoreBeamBackend(64, 4))
    ft, kt = drive(t, CoreBeamBackend(64, 4))
    assert kc == kt and max(kc) == width
    assert finished_key(fc) == finished_key(ft)
    g = [f for f in fc if f.request_id == 1][0]
    assert isinstance(g, qualia.FinishedGroup) and g.member_ids == []
    assert beams_of(g) == dense_beams(PROMPT, width, 6, eos_token_id=eos)
    assert g.scores == sorted(g.scores, reverse=True)
    assert c.forks == t.forks and c.parked == t.parked
    assert c.free_pages == c.num_pages


def test_beam_search_with_stop_ids_and_run_with_a_python_backend():
    """run() takes (ids, topk_ids, topk_logprobs) from a Python backend; stop ids finish
    hypotheses early, as in the dense search."""
    first = [tk for tk, _ in dense_beams(PROMPT, 4, 1)]
    stop = [first[0][0], first[2][0]]
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=6, beam_width=4, stop_token_ids=stop)
    r = c.run(CoreBeamBackend(64, 4))
    g = r.finished[0]
    assert beams_of(g) == dense_beams(PROMPT, 4, 6, stop_token_ids=stop)
    assert "stop" in g.finish_reasons
    assert c.free_pages == c.num_pages


def test_beams_under_preemption_park_and_match_the_twin():
    """Two beam groups and an n group on a small pool: preemption, parking (a computed beam
    waits for a queued sibling) and fork fallbacks; plans, results and counters agree with the
    twin step for step, and each group equals its dense search."""
    kw = dict(max_num_batched_tokens=6, max_num_seqs=3, max_queued=24)
    c = qualia.StepScheduler(12, 2, 12, **kw)
    t = TwinStepScheduler(12, 2, 12, **kw)
    for s in (c, t):
        s.add_request(1, PROMPT[:7], max_new_tokens=5, beam_width=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=5, n=2, priority=1)
        s.add_request(3, PROMPT[3:], max_new_tokens=4, beam_width=2)
    bc, bt = CoreBeamBackend(12, 2), CoreBeamBackend(12, 2)
    fc, ft = [], []
    while c.has_unfinished() or t.has_unfinished():
        pc, pt = c.schedule(), t.schedule()
        assert_same_plan(pc, pt)
        oc, ot = bc.execute_step(pc), bt.execute_step(pt)
        fc += c.update(*oc) if isinstance(oc, tuple) else c.update(oc)
        ft += t.update(*ot) if isinstance(ot, tuple) else t.update(ot)
        assert [c.pool.refcount(p) for p in range(12)] == \
            [t.facade.pool.refcount(p) for p in range(12)]
    assert finished_key(fc) == finished_key(ft)
    assert (c.forks, c.fork_fallbacks, c.parked) == (t.forks, t.fork_fallbacks, t.parked)
    assert c.parked > 0 and c.fork_fallbacks > 0       # the case this test is about
    got = {f.request_id: f for f in fc}
    assert beams_of(got[1]) == dense_beams(PROMPT[:7], 3, 5)
    assert beams_of(got[3]) == dense_beams(PROMPT[3:], 2, 4)


def test_a_beam_group_holds_its_width_of_queue_entries():
    c = qualia.StepScheduler(64, 4, 16, 4, max_queued=5)
    t = TwinStepScheduler(64, 4, 16, 4, max_queued=5)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
        with pytest.raises(StepError.QueueFull):
            s.add_request(2, PROMPT, max_new_tokens=3, beam_width=3)
        s.add_request(3, PROMPT, max_new_tokens=3, n=2)
        with pytest.raises(StepError.QueueFull):
            s.add_request(4, PROMPT, max_new_tokens=3)
        s.abort(1)
        s.add_request(5, PROMPT, max_new_tokens=3, beam_width=3)


@pytest.mark.parametrize("kw,exc", [(dict(beam_width=0), ValueError),
                                    (dict(beam_width=9), ValueError),
                                    (dict(beam_width=True), TypeError),
                                    (dict(beam_width=2.0), TypeError),
                                    (dict(beam_width="2"), TypeError),
                                    (dict(beam_width=2, n=2), ValueError)])
def test_bad_beam_width_changes_nothing(kw, exc):
    c = qualia.StepScheduler(64, 4, 16, 8)
    t = TwinStepScheduler(64, 4, 16, 8)
    for s in (c, t):
        with pytest.raises(exc):
            s.add_request(1, PROMPT, max_new_tokens=3, **kw)
        assert not s.has_unfinished()
        s.add_request(1, PROMPT, max_new_tokens=3)


def test_beams_that_cannot_fit_side_by_side_never_fit():
    # 4 beams of a 10-token prompt and 6 new tokens on 4-token pages: 2 shared + 4 x 2 pages
    for s in (qualia.StepScheduler(9, 4, 16, 8), TwinStepScheduler(9, 4, 16, 8)):
        with pytest.raises(StepError.NeverFits):
            s.add_request(1, PROMPT, max_new_tokens=6, beam_width=4)
        s.add_request(1, PROMPT, max_new_tokens=6, beam_width=3)


@pytest.mark.parametrize("bad", ["missing", "one", "narrow", "float_ids", "vocab", "negative",
                                 "strings", "rows", "unsorted"])
def test_bad_candidates_change_nothing(bad):
    """A beam plan's update without valid [m, num_topk] candidates raises and leaves the plan
    pending with nothing applied; the same update with good candidates then matches the
    twin."""
    c = qualia.StepScheduler(64, 4, 16, 8, vocab_size=64)
    t = TwinStepScheduler(64, 4, 16, 8, vocab_size=64)
    b = CoreBeamBackend(64, 4)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    pc = c.schedule()
    assert_same_plan(pc, t.schedule())
    ids, tids, tlps = b.execute_step(pc)
    args = {"missing": (ids,), "one": (ids, tids), "narrow": (ids, tids[:, :1], tlps[:, :1]),
            "float_ids": (ids, tids.astype(np.float64), tlps),
            "vocab": (ids, np.full_like(tids, 64), tlps),
            "negative": (ids, -tids - 1, tlps), "strings": (ids, tids, [["a", "b"]]),
            "rows": (ids, np.vstack([tids, tids]), np.vstack([tlps, tlps])),
            "unsorted": (ids, tids[:, ::-1], tlps[:, ::-1])}[bad]   # not best first
    for s in (c, t):
        with pytest.raises((ValueError, TypeError)):
            s.update(*args)
    assert c.request_tokens(1).tolist() == PROMPT and c.forks == 0
    assert finished_key(c.update(ids, tids, tlps)) == finished_key(t.update(ids, tids, tlps))
    assert c.forks == t.forks == 1
    assert c.group_members(1) == t.group_members(1)


def test_a_plan_without_beam_rows_ignores_candidates():
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=3)
    plan = c.schedule()
    assert plan.num_topk == 0
    assert c.update([5], object(), "not an array") == []


def test_beams_in_the_c_run_loop_equal_a_python_loop_and_the_twin():
    """run(HashBackend()) runs beam groups without the GIL (the backend writes candidates);
    the same HashBackend through a Python loop, and the twin, plan and finish the same."""
    hb = qualia.HashBackend(vocab=64)
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4, max_prefill_chunk=6, max_queued=32)
    a, b = qualia.StepScheduler(40, 4, 16, **kw), qualia.StepScheduler(40, 4, 16, **kw)
    t = TwinStepScheduler(40, 4, 16, **kw)
    for s in (a, b, t):
        s.add_request(1, PROMPT, max_new_tokens=5, beam_width=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=6, n=2)
        s.add_request(3, PROMPT[2:], max_new_tokens=4, beam_width=2, eos_token_id=7)
    result = a.run(hb)

    class Py:
        def execute_step(self, plan):
            return hb.execute_step_topk(plan) if plan.num_topk else hb.execute_step(plan)
    rb, rt = b.run(Py()), t.run(Py())
    assert np.array_equal(result.stats, rb.stats) and np.array_equal(result.stats, rt.stats)
    assert finished_key(result.finished) == finished_key(rb.finished) == \
        finished_key(rt.finished)
    assert sorted(f.request_id for f in result.finished if f.scores is not None) == [1, 3]
    assert a.forks == t.forks > 0 and a.free_pages == a.num_pages


def test_hash_backend_candidates_follow_its_rule():
    hb = qualia.HashBackend(vocab=50)
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=3, beam_width=4)
    plan = c.schedule()
    ids, tids, tlps = hb.execute_step_topk(plan)
    assert np.array_equal(ids, hb.execute_step(plan))
    assert tids.shape == tlps.shape == (1, 4) and tids.dtype == np.uint32
    assert tids[0].tolist() == [(int(ids[0]) + j) % 50 for j in range(4)]
    t = int(plan.logits_indices[0])
    assert tlps[0, 0] == qualia.hash_logprob(1, int(plan.positions[t]), int(plan.input_ids[t]))
    assert all(np.diff(tlps[0]) < 0)


@pytest.mark.parametrize("kind", ["c", "cython"])
def test_run_refuses_a_beam_plan_for_a_c_backend_without_candidates(example_backend,
                                                                    cython_backend, kind):
    """A C step backend that does not declare QUALIA_STEP_WRITES_TOPK (the examples built with
    topk=False) gets no beam plan: while a beam group is queued or running, run() refuses it
    before any step and changes nothing."""
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(2, PROMPT[:3], max_new_tokens=2)
    c.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    before = (c.num_waiting, c.num_running, c.free_pages, c.request_tokens(1).tolist())
    without = (example_backend.new_step(64, topk=False) if kind == "c"
               else cython_backend.StepBackend(64, topk=False))
    with pytest.raises(TypeError, match="QUALIA_STEP_WRITES_TOPK"):
        c.run(without)
    assert (c.num_waiting, c.num_running, c.free_pages, c.request_tokens(1).tolist()) == before
    assert before[:2] == (2, 0)
    r = c.run(qualia.HashBackend(vocab=64))
    assert len(r.finished) == 2 and c.free_pages == c.num_pages


class PyExampleBeams:
    """The step examples' rule (examples/c_backend: sampled tokens and beam candidates), as a
    Python step backend."""

    def __init__(self, vocab):
        self.vocab = vocab

    def execute_step(self, plan):
        if plan.num_topk:
            return example_topk_rule(plan, self.vocab, plan.num_topk)
        return example_rule(plan, self.vocab)


@pytest.mark.parametrize("kind", ["c", "cython"])
@pytest.mark.parametrize("budget,seqs,blocks,page_tokens,preempts", [
    (2048, 8, 64, 4, False), (7, 3, 24, 4, False), (16, 6, 12, 2, True)])
def test_example_step_backends_run_beam_groups(example_backend, cython_backend, kind, budget,
                                               seqs, blocks, page_tokens, preempts):
    """run(example step backend) writes candidates without the GIL: every beam group finishes
    with `width` hypotheses, best first, and the run (preemptions included, on a small pool)
    equals driving schedule/update by hand with the same rule in Python, and the twin fed that
    rule."""
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_prefill_chunk=6,
              max_queued=32)
    a, b, t = (cls(blocks, page_tokens, 16, **kw)
               for cls in (qualia.StepScheduler, qualia.StepScheduler, TwinStepScheduler))
    widths = {1: 3, 3: 2, 4: 1}
    for s in (a, b, t):
        s.add_request(1, PROMPT, max_new_tokens=5, beam_width=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=6, n=2)
        s.add_request(3, PROMPT[2:], max_new_tokens=4, beam_width=2, eos_token_id=7)
        s.add_request(4, PROMPT[1:6], max_new_tokens=3, beam_width=1)
        s.add_request(5, PROMPT[3:], max_new_tokens=4)
    backend = (example_backend.new_step(64) if kind == "c" else cython_backend.StepBackend(64))
    result = a.run(backend)
    py = PyExampleBeams(64)
    by_hand, topk = drive(b, py)
    rt = t.run(py)
    assert finished_key(result.finished) == finished_key(by_hand) == finished_key(rt.finished)
    assert np.array_equal(result.stats, rt.stats) and max(topk) == 3
    assert (int(result.stats["num_preempted"].sum()) > 0) == preempts
    groups = {f.request_id: f for f in result.finished
              if isinstance(f, qualia.FinishedGroup) and f.scores is not None}
    assert sorted(groups) == sorted(widths)
    for rid, g in groups.items():
        assert len(g.outputs) == len(g.scores) == widths[rid]
        assert g.scores == sorted(g.scores, reverse=True)
    assert a.forks == t.forks and a.free_pages == a.num_pages


def _parked_beams_finished(cls):
    # beams parked under a tight budget, and before every update as many fresh requests added
    # and aborted as fill the finished-id list up to the sampled rows and running requests: a
    # selection that stops parked beams must still report each of them
    rng = np.random.default_rng(13)
    modes = random.Random(13)
    queued, seqs = 24, 3
    s = cls(10, 2, 12, max_num_batched_tokens=3, max_num_seqs=seqs, max_queued=queued,
            cache_key=b"p" * 16)
    s.add_request(0, [5, 5, 4], max_new_tokens=5, eos_token_id=1, beam_width=3)
    s.add_request(1, [5], max_new_tokens=6, priority=2, beam_width=3)
    s.add_request(2, [0, 4, 5], max_new_tokens=3, priority=1, eos_token_id=1, beam_width=3)
    seen, reported, filler = set(), [], 10**12
    while True:
        plan = s.schedule()
        seen.update(plan.request_ids.tolist())
        reported += plan.finished_request_ids.tolist()
        if not s.has_unfinished() and not len(plan.request_ids):
            return s.parked, seen, reported
        for _ in range(queued + seqs - len(plan.logits_indices) - s.num_running):
            filler += 1
            s.add_request(filler, [1], max_new_tokens=1)
            s.abort(filler)
        m, k = len(plan.logits_indices), plan.num_topk
        ids = rng.integers(0, 32, m).astype(np.uint32)
        if not k:
            s.update(ids)
            continue
        mode = modes.choice([0, 0, 1, 3])
        cand = np.array([rng.permutation(32)[:k] for _ in range(m)]).reshape(m, k)
        if mode == 0:
            lps = -0.25 * np.sort(rng.integers(0, 4, size=(m, k)), axis=1)
        elif mode == 1:     # one finite candidate a row at most: beams run out and park
            lps = np.full((m, k), -np.inf)
            lps[:, 0] = rng.choice([0.0, -0.0, -np.inf, -1e308], size=m)
        else:               # all tied
            lps = np.zeros((m, k))
        s.update(ids, cand, lps)


def test_beams_a_selection_stops_while_parked_are_reported_finished_with_a_full_list():
    parked, seen, reported = _parked_beams_finished(qualia.StepScheduler)
    assert parked > 0
    assert seen <= set(reported)
    assert (parked, seen, reported) == _parked_beams_finished(qualia.twin.StepScheduler)
