"""Parallel sampling (``add_request(..., n=k)``) in the compiled engine step and its twin
``qualia.twin.StepScheduler`` (docs/DESIGN.md, "Forks at the step level"), one rule per test:
``n`` as any integer and its checks, user ids in the child range, updates and discards around the
fork step, aborts at every phase of a group, the queue's capacity, a backend failing mid-group,
calls from other threads and from gc callbacks, the engine's counters and ``--check`` of groups,
and every member's tokens equal to its dense run (``qualia.model``'s seeded per-member sampler)
and to the twin's, in the C run loop and a Python loop, with and without prefix caching.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from helpers.groups import CHILD, DENSE, HOT, PROMPT, Index, LyingInt, W, group_snapshot
from helpers.step_checks import finished_key
from helpers.step_machine import VOCAB
from hypothesis import given, settings
from hypothesis import strategies as st

import qualia
from qualia.errors import BusyError, StepError
from qualia.model import PagedModelBackend
from qualia.sim.adapters import PlanModelSteps
from qualia.twin import StepScheduler as TwinStepScheduler


def queued(s):
    return list(s.requests())


# -- single rules, core and twin side by side --------------------------------------------------

HB = qualia.HashBackend(vocab=VOCAB)


def both_kinds(**kw):
    args = (64, 4, 16)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_queued", 32)
    kw.setdefault("vocab_size", VOCAB)
    return qualia.StepScheduler(*args, **kw), TwinStepScheduler(*args, **kw)


class PyHash:
    """execute_step through the hash rule (a Python backend: run() calls it per step)."""

    def __init__(self, fail_at=None, during=None):
        self.step, self.fail_at, self.during = 0, fail_at, during

    def execute_step(self, plan):
        self.step += 1
        if self.during is not None:
            self.during(plan)
        if self.fail_at is not None and self.fail_at(self.step, plan):
            raise RuntimeError("backend failed")
        return np.asarray(HB.execute_step(plan), dtype=np.uint32)


def ref(member, prompt, max_new):
    from qualia.sim.check import hash_generate

    return hash_generate(member, prompt, max_new, None, VOCAB)


@pytest.mark.parametrize("kind", ["core", "twin"])
@pytest.mark.parametrize("make", [lambda: np.int64(3), lambda: np.uint8(3), lambda: Index(3)],
                         ids=["int64", "uint8", "__index__"])
@pytest.mark.parametrize("name", ["n", "beam_width"])
def test_n_takes_any_integer(kind, make, name, request):
    s = both_kinds()[kind == "twin"]
    s.add_request(1, PROMPT, max_new_tokens=2, **{name: make()})
    assert len(s.group_members(1)) == (3 if name == "n" else 1)
    with pytest.raises(StepError.DuplicateRequest):     # the group holds its 3 entries
        s.add_request(1, PROMPT, max_new_tokens=2)


@pytest.mark.parametrize("kind", ["core", "twin"])
@pytest.mark.parametrize("n", [LyingInt(0), LyingInt(-5), LyingInt(2**40)],
                         ids=["0", "-5", "2**40"])
def test_n_range_is_checked_on_its_value(kind, n, request):
    s = both_kinds()[kind == "twin"]
    before = group_snapshot(s)
    with pytest.raises(ValueError, match="n must be in"):
        s.add_request(1, PROMPT, max_new_tokens=2, n=n)
    assert group_snapshot(s) == before


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_n_whose_index_raises_or_adds_the_same_id_changes_nothing_else(kind, request):
    s = both_kinds()[kind == "twin"]

    def boom():
        raise KeyError("user code")

    before = group_snapshot(s)
    with pytest.raises(KeyError):
        s.add_request(1, PROMPT, max_new_tokens=2, n=Index(2, boom))
    assert group_snapshot(s) == before
    # __index__ runs before the scheduler is owned: its own add_request of the same id is
    # seen by the duplicate check, and only its request remains
    n = Index(2, lambda: s.add_request(1, PROMPT[:3], max_new_tokens=1))
    with pytest.raises(StepError.DuplicateRequest):
        s.add_request(1, PROMPT, max_new_tokens=2, n=n)
    assert s.request_tokens(1).tolist() == PROMPT[:3] and s.num_waiting == 1


def test_bool_and_numpy_bool_n_are_refused_by_both():
    for s in both_kinds():
        for n in (True, np.bool_(True)):
            with pytest.raises(TypeError):
                s.add_request(1, PROMPT, max_new_tokens=2, n=n)
        assert not s.has_unfinished()


def test_user_ids_in_the_child_range_are_skipped_and_taken_ids_refused():
    c, t = both_kinds()
    for s in (c, t):
        s.add_request(CHILD, PROMPT, max_new_tokens=1)
        s.add_request(CHILD + 2, PROMPT, max_new_tokens=1)
        s.add_request(2**64 - 1, PROMPT, max_new_tokens=3, n=4)
    assert c.group_members(2**64 - 1) == t.group_members(2**64 - 1) == \
        [2**64 - 1, CHILD + 1, CHILD + 3, CHILD + 4]
    for s in (c, t):
        before = group_snapshot(s)
        for rid in (CHILD + 1, CHILD + 3, CHILD + 4, 2**64 - 1):
            with pytest.raises(StepError.DuplicateRequest):
                s.add_request(rid, PROMPT, max_new_tokens=1)
        assert group_snapshot(s) == before
        r = s.run(PyHash())
        g = [f for f in r.finished if isinstance(f, qualia.FinishedGroup)][0]
        assert [o.tolist() for o in g.outputs] == [ref(m, PROMPT, 3) for m in g.member_ids]
        # once the group's result is out its ids are free again
        s.add_request(CHILD + 1, PROMPT, max_new_tokens=1)
        with pytest.raises(StepError.UnknownRequest):
            s.group_members(2**64 - 1)


def test_children_added_while_a_plan_is_pending_skip_ids_aborted_in_it():
    """An n group added while the plan is pending reserves its children's ids then: an id
    aborted in that plan still names the aborted request's pages, so the children skip it."""
    c, t = both_kinds()
    for s in (c, t):
        s.add_request(CHILD, PROMPT, max_new_tokens=3)
        plan = s.schedule()
        s.abort(CHILD)
        s.add_request(7, PROMPT, max_new_tokens=3, n=3)
        s.update(PyHash().execute_step(plan))
    assert c.group_members(7) == t.group_members(7) == [7, CHILD + 1, CHILD + 2]
    for s in (c, t):
        r = s.run(PyHash())
        g = [f for f in r.finished if isinstance(f, qualia.FinishedGroup)][0]
        assert [o.tolist() for o in g.outputs] == [ref(m, PROMPT, 3) for m in g.member_ids]
    c.clear_cache()
    assert c.free_pages == c.num_pages


@pytest.mark.parametrize("rows", ["one per request", "one more", "one fewer"])
def test_update_with_the_wrong_number_of_ids_on_repeated_rows_changes_nothing(rows):
    for s in both_kinds():
        s.add_request(1, PROMPT, max_new_tokens=3, n=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=3, n=2)
        plan = s.schedule()
        m = len(plan.logits_indices)
        assert m == 5 and len(plan.request_ids) == 2
        k = {"one per request": 2, "one more": m + 1, "one fewer": m - 1}[rows]
        before = group_snapshot(s)
        with pytest.raises(ValueError, match="samples 5 rows"):
            s.update(np.ones(k, dtype=np.uint32))
        assert group_snapshot(s) == before
        assert s.update(np.ones(m, dtype=np.uint32)) == [] and s.forks == 3


def test_discard_plan_around_the_fork_step_replans_the_same_rows():
    c, t = both_kinds()
    plans = []
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, n=3)
        first = s.schedule()
        keep = (first.logits_indices.tolist(), first.sampled_request_ids.tolist(),
                first.input_ids.tolist(), first.slot_mapping.tolist())
        s.discard_plan()
        assert s.forks == 0 and s.num_running == 1
        again = s.schedule()
        assert (again.logits_indices.tolist(), again.sampled_request_ids.tolist(),
                again.input_ids.tolist(), again.slot_mapping.tolist()) == keep
        s.update(np.asarray(HB.execute_step(again), dtype=np.uint32))
        plan = s.schedule()              # the forked members' first decode, then discarded
        s.discard_plan()
        plans.append(group_snapshot(s))
        r = s.run(PyHash())
        g = r.finished[0]
        assert [o.tolist() for o in g.outputs] == [ref(m, PROMPT, 3) for m in g.member_ids]
        assert plan.copies.size == 2
    assert plans[0] == plans[1]


def _stop_for_member_one():
    # a stop id that member 1 (the first child) draws at its second token and the others not
    # in their first four: member 1 stops while its siblings run
    a, b, c = (ref(m, PROMPT, 6) for m in (1, CHILD, CHILD + 1))
    tok = b[1]
    assert tok not in a[:4] and tok not in c[:4] and tok not in b[:1]
    return [tok]


@pytest.mark.parametrize("phase", ["reserved", "pending fork plan", "member stopped",
                                   "pending decode plan", "after result"])
def test_abort_the_group_at_every_phase_agrees_with_the_twin(phase):
    c, t = both_kinds(max_num_seqs=4)
    seen = []
    stop = _stop_for_member_one()
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=6, n=3, stop_token_ids=stop)
        s.add_request(2, PROMPT[:5], max_new_tokens=2)
        members = s.group_members(1)
        assert members == [1, CHILD, CHILD + 1]
        if phase != "reserved":
            plan = s.schedule()
            if phase == "pending fork plan":
                assert plan.sampled_request_ids.tolist()[:3] == members
                s.abort(1)
                s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
            else:
                s.update(np.asarray(HB.execute_step(plan), dtype=np.uint32))
        if phase == "member stopped":
            while CHILD in queued(s):
                plan = s.schedule()
                s.update(np.asarray(HB.execute_step(plan), dtype=np.uint32))
            assert {1, CHILD + 1} <= set(queued(s))
        if phase == "pending decode plan":
            plan = s.schedule()
            assert set(members) <= set(plan.request_ids.tolist())
        if phase == "after result":
            s.run(PyHash())
            with pytest.raises(StepError.UnknownRequest):
                s.abort(1)
            with pytest.raises(StepError.UnknownRequest):
                s.abort(members[1])
        else:
            if phase != "pending fork plan":
                before = group_snapshot(s)
                with pytest.raises(StepError.UnknownRequest):
                    s.abort(members[2])         # a member alone
                assert group_snapshot(s) == before
                s.abort(1)
            if phase == "pending decode plan":
                s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
        with pytest.raises(StepError.UnknownRequest):
            s.group_members(1)
        r = s.run(PyHash())
        plan = s.schedule()
        fins = plan.finished_request_ids.tolist()
        s.update([])
        seen.append((group_snapshot(s),
                     [getattr(f, "member_ids", f.request_id) for f in r.finished], fins))
        assert not s.has_unfinished()
        assert getattr(s, "facade", s).free_pages == getattr(s, "facade", s).num_pages
        # every id of the group is free again
        for m in members:
            s.add_request(m, PROMPT[:2], max_new_tokens=1)
    assert seen[0] == seen[1]


def test_queue_of_exactly_n_entries_and_fewer_seqs_than_requests():
    # max_queued == max_num_seqs == n: the group takes the whole queue until its result
    for s in (qualia.StepScheduler(64, 4, 16, 3, max_queued=3, vocab_size=VOCAB),
              TwinStepScheduler(64, 4, 16, 3, max_queued=3, vocab_size=VOCAB)):
        s.add_request(1, PROMPT, max_new_tokens=2, n=3)
        before = group_snapshot(s)
        with pytest.raises(StepError.QueueFull):
            s.add_request(2, PROMPT, max_new_tokens=1)
        assert group_snapshot(s) == before
        with pytest.raises(ValueError, match="max_num_seqs=3"):
            s.add_request(2, PROMPT, max_new_tokens=1, n=4)
        r = s.run(PyHash())
        assert [o.tolist() for o in r.finished[0].outputs] == \
            [ref(m, PROMPT, 2) for m in r.finished[0].member_ids]
        s.add_request(2, PROMPT, max_new_tokens=1, n=3)


def test_a_backend_failing_mid_group_reports_what_finished_and_resumes_exactly():
    c, t = both_kinds(max_num_seqs=4, max_num_batched_tokens=8)
    outcome = []
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=5, n=3)
        s.add_request(2, PROMPT[:3], max_new_tokens=1)
        members = s.group_members(1)
        # fail at the first step where the forked members decode side by side
        fail = PyHash(fail_at=lambda k, plan: set(members) <= set(plan.request_ids.tolist()))
        with pytest.raises(RuntimeError) as err:
            s.run(fail)
        done = [f.request_id for f in err.value.finished]
        mid = group_snapshot(s)
        r = s.run(PyHash())
        g = r.finished[0]
        assert [o.tolist() for o in g.outputs] == [ref(m, PROMPT, 5) for m in members]
        outcome.append((done, mid, s.forks, s.fork_fallbacks))
        assert getattr(s, "facade", s).free_pages == getattr(s, "facade", s).num_pages
    assert outcome[0] == outcome[1] and outcome[0][0] == [2]


def test_calls_from_the_backend_thread_or_another_thread_are_busy_and_change_nothing():
    s = qualia.StepScheduler(64, 4, 16, 8, vocab_size=VOCAB)
    s.add_request(1, PROMPT, max_new_tokens=4, n=3)
    got = []

    def other_thread(plan):
        def calls():
            for f in (lambda: s.add_request(5, PROMPT, max_new_tokens=1, n=2),
                      lambda: s.abort(1), lambda: s.discard_plan(),
                      lambda: s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))):
                try:
                    f()
                    got.append("ran")
                except BusyError:
                    got.append("busy")
        th = threading.Thread(target=calls)
        th.start()
        th.join()
        calls()                              # and from the backend itself

    r = s.run(PyHash(during=other_thread))
    assert set(got) == {"busy"} and len(got) >= 8
    g = r.finished[0]
    assert [o.tolist() for o in g.outputs] == [ref(m, PROMPT, 4) for m in g.member_ids]


def test_gc_callbacks_during_update_are_busy_and_the_group_result_is_whole():
    s = qualia.StepScheduler(64, 4, 16, 8, vocab_size=VOCAB)
    s.add_request(1, PROMPT, max_new_tokens=1, n=4)
    members = s.group_members(1)
    plan = s.schedule()
    ids = np.asarray(HB.execute_step(plan), dtype=np.uint32)
    hits = []

    def cb(phase, info):
        if phase == "start":
            for f in (lambda: s.abort(1), lambda: s.add_request(9, PROMPT, max_new_tokens=1,
                                                               n=2)):
                try:
                    f()
                    hits.append("ran")
                except BusyError:
                    hits.append("busy")

    old = gc.get_threshold()
    gc.callbacks.append(cb)
    gc.set_threshold(1, 1, 1)
    try:
        out = s.update(ids)
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(cb)
    assert hits and set(hits) == {"busy"}
    assert len(out) == 1 and out[0].member_ids == members
    assert [o.tolist() for o in out[0].outputs] == [ref(m, PROMPT, 1) for m in members]
    assert not s.has_unfinished() and s.free_pages == s.num_pages


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_an_add_request_made_by_the_prompt_iterator_leaves_the_group_whole(kind):
    # the twin passed the group's entry count through an attribute that the nested call
    # deleted: the outer call then raised AttributeError with its request queued, groupless
    s = both_kinds(max_queued=8)[kind == "twin"]

    def prompt():
        s.add_request(2, [1, 2], max_new_tokens=1)
        yield from PROMPT

    s.add_request(1, prompt(), max_new_tokens=2, n=3)
    assert s.group_members(1) == [1, CHILD, CHILD + 1] and s.num_waiting == 2
    # the capacity check counts the outer group's n entries, not the nested call's one
    s.add_request(3, PROMPT, max_new_tokens=1)          # 3 + 1 + 1 = 5 of 8

    def prompt2():
        s.add_request(4, [1, 2], max_new_tokens=1)     # 6 of 8
        yield from PROMPT

    before = None
    with pytest.raises(StepError.QueueFull):
        before = group_snapshot(s)
        s.add_request(5, prompt2(), max_new_tokens=2, n=3)
    assert before is not None and 4 in queued(s) and 5 not in queued(s)
    with pytest.raises(StepError.UnknownRequest):
        s.group_members(5)
    r = s.run(PyHash())
    assert sorted(f.request_id for f in r.finished) == [1, 2, 3, 4]


def test_abort_of_a_member_from_the_backend_is_busy_in_both():
    # the twin looked a member's id up before its ownership check: UnknownRequest, where the
    # core (which owns first) says BusyError
    for s in both_kinds():
        s.add_request(1, PROMPT, max_new_tokens=3, n=3)
        members = s.group_members(1)
        got = []

        def during(plan):
            for rid in (members[1], 1, 12345):
                try:
                    s.abort(rid)
                    got.append("ran")
                except BusyError:
                    got.append("busy")
                except StepError.UnknownRequest:
                    got.append("unknown")

        s.run(PyHash(during=during))
        assert set(got) == {"busy"}, (type(s).__name__, got)


@settings(max_examples=600, deadline=None)
@given(mode=st.sampled_from(["off", "auto"]), num_blocks=st.integers(4, 20),
       page_tokens=st.sampled_from([1, 2, 4]), seqs=st.integers(1, 6),
       budget=st.integers(1, 20), chunk=st.sampled_from([None, 1, 3]),
       reqs=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 9), st.integers(1, 7),
                               st.booleans()), min_size=1, max_size=6),
       c_loop=st.booleans())
def test_groups_under_pressure_equal_the_hash_rule_in_both_cache_modes(
        mode, num_blocks, page_tokens, seqs, budget, chunk, reqs, c_loop):
    """Tiny pools and budgets (preemption of members holding shared pages, fork fallbacks),
    prefix caching off or automatic, user ids among the child ids, the C loop or a Python
    backend: every member is its own hash-rule run and every page comes back (the twin models
    'auto' only, so 'off' is checked against the rule alone)."""
    s = qualia.StepScheduler(num_blocks, page_tokens, 16, seqs, prefix_caching=mode,
                             max_num_batched_tokens=budget, max_prefill_chunk=chunk,
                             vocab_size=VOCAB, max_queued=24)
    want = {}
    for i, (n, length, max_new, high) in enumerate(reqs):
        rid = CHILD + i if high else i
        prompt = [(7 * i + j) % 50 for j in range(length)]
        try:
            s.add_request(rid, prompt, max_new_tokens=max_new, n=min(n, seqs))
        except (StepError.NeverFits, StepError.QueueFull):  # groups past max_queued's entries
            continue
        except StepError.DuplicateRequest:  # a user id a group's child took
            assert high
            continue
        want[rid] = (prompt, max_new, s.group_members(rid) if min(n, seqs) > 1 else None)
    r = s.run(HB if c_loop else PyHash(), max_steps=5000)
    assert not s.has_unfinished()
    got = {f.request_id: f for f in r.finished}
    assert set(got) == set(want)
    for rid, (prompt, max_new, members) in want.items():
        f = got[rid]
        if members is None:
            assert f.output_tokens.tolist() == ref(rid, prompt, max_new)
        else:
            assert f.member_ids == members and len(set(members)) == len(members)
            assert [o.tolist() for o in f.outputs] == [ref(m, prompt, max_new)
                                                      for m in members]
    assert s.free_pages == s.num_pages
    assert all(s.pool.refcount(p) in (0, 1) for p in range(num_blocks))


class CoreModelBackend:
    """execute_step for qualia.StepScheduler over the paged numpy model (the simulator's
    adapter)."""

    def __init__(self, num_blocks, page_tokens):
        self.b = PlanModelSteps(PagedModelBackend(W, num_blocks, page_tokens, sampling=HOT))

    def execute_step(self, plan):
        return np.asarray(self.b.execute_step(plan), dtype=np.uint32)


@pytest.mark.parametrize("page_tokens,prompt_len", [(4, 10), (4, 8), (1, 5), (3, 10)])
@pytest.mark.parametrize("budget,seqs", [(2048, 8), (3, 8), (64, 4)])
def test_every_member_equals_its_dense_run_and_the_twin(page_tokens, prompt_len, budget, seqs):
    """Each member's tokens equal DenseModel.generate with the member's id; the core's run
    equals the twin's step for step (stats and results)."""
    prompt = PROMPT[:prompt_len]
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_queued=32)
    c = qualia.StepScheduler(64, page_tokens, 32, **kw)
    t = TwinStepScheduler(64, page_tokens, 32, **kw)
    for s in (c, t):
        s.add_request(1, prompt, max_new_tokens=6, n=4)
        s.add_request(2, prompt[:3], max_new_tokens=4)
    members = c.group_members(1)
    assert members == t.group_members(1) and members[0] == 1 and len(set(members)) == 4
    rc = c.run(CoreModelBackend(64, page_tokens))
    rt = t.run(CoreModelBackend(64, page_tokens))
    assert np.array_equal(rc.stats, rt.stats)
    assert finished_key(rc.finished) == finished_key(rt.finished)
    g = [f for f in rc.finished if isinstance(f, qualia.FinishedGroup)][0]
    assert g.request_id == 1 and g.member_ids == members and g.scores is None
    outs = [o.tolist() for o in g.outputs]
    assert outs == [DENSE.generate(prompt, 6, sampling=HOT, request_id=m) for m in members]
    assert len({tuple(o) for o in outs}) > 1
    assert c.forks + c.fork_fallbacks == 3
    assert c.free_pages == c.num_pages


def test_the_prompt_row_is_sampled_once_per_member_and_the_partial_page_copied():
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=3, n=3)
    plan = c.schedule()
    assert plan.logits_indices.tolist() == [len(PROMPT) - 1] * 3
    assert plan.sampled_request_ids.tolist() == c.group_members(1)
    assert c.update([1, 2, 3]) == []
    assert c.num_running == 3 and c.forks == 2
    plan = c.schedule()
    assert len(plan.copies) == 2            # the shared partial page, once per child but the last
    assert plan.block_table_rows.tolist() == [0, 1, 2]
    assert plan.kv_indices.tolist()[:2] == plan.kv_indices.tolist()[3:5]   # full pages shared


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_step_page_counters_count_the_shared_page_copies_as_copies(kind):
    cls = qualia.StepScheduler if kind == "core" else TwinStepScheduler
    s = cls(64, 4, 16, 8)
    s.add_request(1, PROMPT, max_new_tokens=6, n=3)          # 10 tokens: pages 0, 1, 2

    def step(tokens):
        s.schedule()
        s.update(np.array(tokens, np.uint32))

    def pages():
        return s.stats()["pages_allocated"], s.stats()["pages_copied"]

    step([1, 2, 3])                         # the prompt, then the forks
    assert pages() == (3, 0)
    step([4, 5, 6])                         # each child but the last copies the partial page
    assert pages() == (3, 2)
    step([7, 8, 9])                         # position 11: in place
    step([7, 8, 9])                         # position 12: one fresh page per member
    assert pages() == (6, 2)
    assert s.stats()["used_pages"] == 2 + 3 * 2 and s.stats()["num_pages"] == 64


def test_queue_capacity_counts_every_member():
    c = qualia.StepScheduler(64, 4, 16, 4, max_queued=5)
    t = TwinStepScheduler(64, 4, 16, 4, max_queued=5)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, n=4)
        with pytest.raises(StepError.QueueFull):
            s.add_request(2, PROMPT, max_new_tokens=3, n=2)
        s.add_request(3, PROMPT, max_new_tokens=3)
        with pytest.raises(StepError.QueueFull):
            s.add_request(4, PROMPT, max_new_tokens=3)


@pytest.mark.parametrize("kw,exc", [(dict(n=0), ValueError), (dict(n=9), ValueError),
                                    (dict(n=True), TypeError), (dict(n=2.0), TypeError)])
def test_bad_n_changes_nothing(kw, exc):
    c = qualia.StepScheduler(64, 4, 16, 8)
    with pytest.raises(exc):
        c.add_request(1, PROMPT, max_new_tokens=3, **kw)
    assert not c.has_unfinished()


def test_member_ids_are_taken_and_aborting_the_group_releases_everything():
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=5, n=3)
    members = c.group_members(1)
    with pytest.raises(StepError.DuplicateRequest):
        c.add_request(members[1], PROMPT, max_new_tokens=3)
    c.update([1, 2, 3]) if c.schedule() is not None else None
    with pytest.raises(StepError.UnknownRequest):
        c.abort(members[2])                 # a member alone
    c.abort(1)
    assert not c.has_unfinished() and c.free_pages == c.num_pages
    plan = c.schedule()
    assert sorted(plan.finished_request_ids.tolist()) == sorted(members)
    c.update([])
    with pytest.raises(StepError.UnknownRequest):
        c.group_members(1)


def test_groups_in_the_c_run_loop_equal_a_python_loop_and_the_twin():
    """run() with a C step backend (the GIL-free loop) plans and finishes groups as the Python
    loop does, and as the twin does with the same (hash) sampler."""
    hb = qualia.HashBackend()
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4, max_prefill_chunk=6, max_queued=32)
    a, b = qualia.StepScheduler(14, 4, 16, **kw), qualia.StepScheduler(14, 4, 16, **kw)
    t = TwinStepScheduler(14, 4, 16, **kw)
    for s in (a, b, t):
        s.add_request(1, PROMPT, max_new_tokens=5, n=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=6, n=4)
        s.add_request(3, PROMPT[2:], max_new_tokens=4)
    result = a.run(hb)

    class Py:
        def execute_step(self, plan):
            return hb.execute_step(plan)
    rb, rt = b.run(Py()), t.run(Py())
    assert np.array_equal(result.stats, rb.stats) and np.array_equal(result.stats, rt.stats)
    assert finished_key(result.finished) == finished_key(rb.finished) == \
        finished_key(rt.finished)
    assert sorted(type(f).__name__ for f in result.finished) == \
        ["FinishedGroup", "FinishedGroup", "FinishedRequest"]
    assert a.free_pages == a.num_pages


@pytest.mark.parametrize("seqs", [8, 4])
def test_groups_without_prefix_caching_equal_their_dense_runs(seqs):
    """prefix_caching='off' (the twin models 'auto' only): the members still fork and share the
    prompt's pages, and a child queued for lack of a row recomputes its prompt."""
    c = qualia.StepScheduler(64, 4, 32, seqs, prefix_caching="off", max_queued=32)
    c.add_request(1, PROMPT, max_new_tokens=6, n=4)
    c.add_request(2, PROMPT[:3], max_new_tokens=4)
    members = c.group_members(1)
    r = c.run(CoreModelBackend(64, 4))
    g = [f for f in r.finished if isinstance(f, qualia.FinishedGroup)][0]
    assert [o.tolist() for o in g.outputs] == \
        [DENSE.generate(PROMPT, 6, sampling=HOT, request_id=m) for m in members]
    assert c.forks + c.fork_fallbacks == 3 and (c.fork_fallbacks > 0) == (seqs == 4)
    assert c.free_pages == c.num_pages
