"""Hostile review of parallel sampling (``add_request(..., n=k)``) in the compiled engine step
and its twin ``qualia.twin.StepScheduler`` (docs/DESIGN.md, "Forks at the step level").

The stateful test extends ``ForksVsTwin`` with what it does not reach: user ids in the range
of the internal child ids (from 2**63 up) and at 2**64-1, a group aborted in its pending plan
and its id added again at once, and every refused call checked to change nothing (a snapshot of
the queues, every request's tokens, every group's members, every page's refcount and the fork
counters before and after).  The other tests pin single rules.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_step_forks_core import ForksVsTwin
from test_step_stateful import ALLOWED, SETTINGS, VOCAB

import qualia
from qualia.errors import BusyError, StepError
from qualia.twin import StepScheduler as TwinStepScheduler
from qualia.twin.groups import CHILD_BASE

CHILD = CHILD_BASE
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
IDS = [0, 1, 2, 3, CHILD, CHILD + 1, CHILD + 2, CHILD + 3, 2**64 - 1, 2**64 - 2]


def queued(s):
    return list(s.requests())


def snapshot(s):
    """Everything a refused call must leave as it was (core or twin)."""
    f = getattr(s, "facade", s)
    reqs = list(s.requests())
    groups = {}
    for rid in IDS + list(range(0, 64)):
        try:
            groups[rid] = list(s.group_members(rid))
        except StepError.UnknownRequest:
            pass
    return (s.num_waiting, s.num_running, s.has_unfinished(), f.free_pages,
            sorted(reqs), {r: s.request_tokens(r).tolist() for r in reqs}, groups,
            [f.pool.refcount(p) for p in range(f.num_pages)], s.forks, s.fork_fallbacks)


class HostileForks(ForksVsTwin):
    def both(self, fn):
        before = [snapshot(s) for s in (self.core, self.twin)]
        out = []
        for s, snap in zip((self.core, self.twin), before):
            try:
                out.append(("ok", fn(s)))
            except ALLOWED as exc:
                out.append(("err", type(exc)))
                assert snapshot(s) == snap, (type(s).__name__, exc)
        assert out[0][0] == out[1][0], out
        if out[0][0] == "err":
            assert out[0][1] is out[1][1], out
        return out

    @rule(pick=st.sampled_from(IDS), n=st.integers(1, 4), max_new=st.sampled_from([1, 2, 5]),
          tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def add_in_child_range(self, pick, n, max_new, tail):
        # user ids where the children's ids live, and at the top of the u64 range
        self.both(lambda s: s.add_request(pick, [7, 7] + tail, max_new_tokens=max_new, n=n))

    @rule(pick=st.sampled_from(IDS))
    def abort_any(self, pick):
        self.both(lambda s: s.abort(pick))

    @precondition(lambda self: self.plan is not None)
    @rule(n=st.integers(1, 4))
    def abort_planned_group_and_add_it_again(self, n):
        # the first group of the pending plan (by its parent id) aborted, its id added again
        # before update(): the old plan's rows must be ignored, the new group left alone
        for rid in self.plan.request_ids.tolist():
            out = self.both(lambda s: s.group_members(rid))
            if out[0][0] == "ok" and out[0][1][0] == rid:
                self.both(lambda s: s.abort(rid))
                self.both(lambda s: s.add_request(rid, PROMPT, max_new_tokens=3, n=n))
                return

    @rule()
    def groups_agree(self):
        for rid in IDS + list(range(self.next_id + 1)):
            a = self.both(lambda s: s.group_members(rid))
            assert a[0] == a[1]


TestHostileForks = HostileForks.TestCase
TestHostileForks.settings = SETTINGS


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


class Index:
    def __init__(self, value, effect=None):
        self.value, self.effect = value, effect

    def __index__(self):
        if self.effect is not None:
            self.effect()
        return self.value


class LyingInt(int):
    """An int whose comparisons say it is in any range."""

    def __ge__(self, other):
        return True

    def __le__(self, other):
        return True


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
    before = snapshot(s)
    with pytest.raises(ValueError, match="n must be in"):
        s.add_request(1, PROMPT, max_new_tokens=2, n=n)
    assert snapshot(s) == before


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_n_whose_index_raises_or_adds_the_same_id_changes_nothing_else(kind, request):
    s = both_kinds()[kind == "twin"]

    def boom():
        raise KeyError("user code")

    before = snapshot(s)
    with pytest.raises(KeyError):
        s.add_request(1, PROMPT, max_new_tokens=2, n=Index(2, boom))
    assert snapshot(s) == before
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
        before = snapshot(s)
        for rid in (CHILD + 1, CHILD + 3, CHILD + 4, 2**64 - 1):
            with pytest.raises(StepError.DuplicateRequest):
                s.add_request(rid, PROMPT, max_new_tokens=1)
        assert snapshot(s) == before
        r = s.run(PyHash())
        g = [f for f in r.finished if isinstance(f, qualia.FinishedGroup)][0]
        assert [o.tolist() for o in g.outputs] == [ref(m, PROMPT, 3) for m in g.member_ids]
        # once the group's result is out its ids are free again
        s.add_request(CHILD + 1, PROMPT, max_new_tokens=1)
        with pytest.raises(StepError.UnknownRequest):
            s.group_members(2**64 - 1)


@pytest.mark.parametrize("rows", ["one per request", "one more", "one fewer"])
def test_update_with_the_wrong_number_of_ids_on_repeated_rows_changes_nothing(rows):
    for s in both_kinds():
        s.add_request(1, PROMPT, max_new_tokens=3, n=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=3, n=2)
        plan = s.schedule()
        m = len(plan.logits_indices)
        assert m == 5 and len(plan.request_ids) == 2
        k = {"one per request": 2, "one more": m + 1, "one fewer": m - 1}[rows]
        before = snapshot(s)
        with pytest.raises(ValueError, match="samples 5 rows"):
            s.update(np.ones(k, dtype=np.uint32))
        assert snapshot(s) == before
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
        plans.append(snapshot(s))
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
                before = snapshot(s)
                with pytest.raises(StepError.UnknownRequest):
                    s.abort(members[2])         # a member alone
                assert snapshot(s) == before
                s.abort(1)
            if phase == "pending decode plan":
                s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
        with pytest.raises(StepError.UnknownRequest):
            s.group_members(1)
        r = s.run(PyHash())
        plan = s.schedule()
        fins = plan.finished_request_ids.tolist()
        s.update([])
        seen.append((snapshot(s), [getattr(f, "member_ids", f.request_id) for f in r.finished],
                     fins))
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
        before = snapshot(s)
        with pytest.raises(StepError.QueueFull):
            s.add_request(2, PROMPT, max_new_tokens=1)
        assert snapshot(s) == before
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
        mid = snapshot(s)
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


# -- the engine and its check ------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402

from qualia.sim.check import check_groups  # noqa: E402
from qualia.sim.engine import Engine  # noqa: E402
from qualia.sim.workload import Request  # noqa: E402


class RecordingHash:
    """A Python step backend over the hash rule that keeps each plan's sizes."""

    def __init__(self):
        self.hb = qualia.HashBackend(vocab=32000)
        self.plans = []

    def execute_step(self, plan):
        self.plans.append((len(plan.copies), len(plan.logits_indices),
                           len(plan.preempted_request_ids), len(plan.new_request_ids),
                           len(plan.input_ids)))
        return self.hb.execute_step(plan)


def _reqs(lengths, max_new, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, 0, rng.integers(0, 50, k).tolist(), 0, max_new)
            for i, k in enumerate(lengths)]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 4), lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5),
       max_new=st.integers(1, 6), num_blocks=st.integers(10, 30), seqs=st.integers(4, 6),
       budget=st.sampled_from([3, 8, 64]), caching=st.sampled_from(["auto", "off"]))
def test_engine_counters_add_up_to_its_plans(n, lengths, max_new, num_blocks, seqs, budget,
                                             caching):
    rec = RecordingHash()
    engine = Engine(rec, num_pages=num_blocks, max_num_seqs=seqs, page_tokens=3,
                    logical_pages=8, max_num_batched_tokens=budget, prefix_caching=caching, n=n)
    result = engine.run(_reqs(lengths, max_new), check=True)
    st_, plans = result.stats, rec.plans
    assert result.check.ok, result.check.describe()
    copies, rows, preempted, new, tokens = (sum(p[i] for p in plans) for i in range(5))
    assert st_["pages_copied"] == copies
    assert st_["preemptions"] == preempted and st_["admissions"] == new
    assert st_["tokens_scheduled"] == tokens
    # every sampled row is one token of one member, and every member completed
    assert st_["tokens_generated"] == rows == engine.counters.sampled_tokens
    assert st_["forks"] + st_["fork_fallbacks"] == (n - 1) * len(lengths)
    assert st_["forks"] == engine.scheduler.forks
    assert st_["sequences_completed"] == n * len(lengths)
    # every preempted sequence (a forked child too) is resumed once: all of them completed
    assert st_["recomputes"] == st_["preemptions"]
    assert 0 <= st_["pages_saved_at_peak"] <= st_["peak_unshared_pages"]


def _hash_engine_groups(n=3):
    engine = Engine("c", num_pages=64, max_num_seqs=8, page_tokens=4, logical_pages=8, n=n)
    result = engine.run(_reqs([10, 7], 5), check=True)
    assert result.check.ok
    return engine


def test_check_fails_when_every_member_is_keyed_by_the_parent():
    # a scheduler that named every member after its parent would draw n equal sequences, each
    # the parent's reference: the check must not pass them
    engine = _hash_engine_groups()
    g = engine.groups[1]
    g.member_ids[:] = [1, 1, 1]
    g.outputs[:] = [list(g.outputs[0])] * 3
    check = engine.check()
    assert not check.ok and check.mismatched == [1]
    assert "not 3 distinct ids starting with the request's own" in check.describe()


def test_check_fails_when_the_members_are_out_of_order():
    engine = _hash_engine_groups()
    g = engine.groups[0]
    g.member_ids.reverse()
    g.outputs.reverse()              # each output still matches its own id's reference
    check = engine.check()
    assert not check.ok and check.mismatched == [0]


def test_check_fails_when_one_member_token_is_tampered():
    engine = _hash_engine_groups()
    g = engine.groups[0]
    g.outputs[1][-1] = (g.outputs[1][-1] + 1) % 32000
    check = engine.check()
    assert not check.ok and f"request 0 member 1 (id {g.member_ids[1]})" in check.describe()


def test_check_of_a_group_for_an_unknown_request_is_a_failure_not_a_crash():
    engine = _hash_engine_groups()
    groups = dict(engine.groups)
    groups[99] = groups[0]
    check = check_groups(engine._requests, groups, n=3)
    assert not check.ok and "request 99: a group result for a request never submitted" in \
        check.describe()


@pytest.mark.parametrize("value", [np.int64(3), np.uint16(3), Index(3)],
                         ids=["int64", "uint16", "__index__"])
def test_engine_takes_n_by_index(value):
    engine = Engine("c", num_pages=64, max_num_seqs=8, page_tokens=4, logical_pages=8,
                    n=value)
    assert engine.n == 3 and type(engine.n) is int
    assert engine.run(_reqs([6], 2), check=True).check.ok


@pytest.mark.parametrize("value,exc", [(np.bool_(True), TypeError), (LyingInt(0), ValueError),
                                       (LyingInt(99), ValueError), (2.0, TypeError)])
def test_engine_refuses_bad_n(value, exc):
    with pytest.raises(exc, match="n must be"):
        Engine("c", num_pages=64, max_num_seqs=8, page_tokens=4, logical_pages=8, n=value)


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
        before = snapshot(s)
        s.add_request(5, prompt2(), max_new_tokens=2, n=3)
    assert before is not None and 4 in queued(s) and 5 not in queued(s)
    with pytest.raises(StepError.UnknownRequest):
        s.group_members(5)
    r = s.run(PyHash())
    assert sorted(f.request_id for f in r.finished) == [1, 2, 3, 4]


def test_pages_saved_is_never_negative_when_a_forked_child_waits_for_the_budget():
    # n=4 of a one-token prompt, budget 3: after the fork three members decode and copy the
    # shared partial page away; the fourth, in no plan yet, is its last holder.  It used to be
    # left out of the non-sharing count: saved = 3 - 4 = -1
    for caching in ("auto", "off"):
        engine = Engine(RecordingHash(), num_pages=10, max_num_seqs=4, page_tokens=3,
                        logical_pages=8, max_num_batched_tokens=3, prefix_caching=caching, n=4)
        st_ = engine.run(_reqs([1], 2), check=True).stats
        assert st_["peak_held_pages"] == 4 and st_["peak_unshared_pages"] == 4
        assert st_["pages_saved_at_peak"] == 0


def test_a_forked_child_preempted_before_its_first_plan_is_counted_as_resumed():
    # the child (forked at step 4) is preempted before any plan names it, then admitted again:
    # a resume by recompute like any other (it was counted as a first admission)
    rec = RecordingHash()
    engine = Engine(rec, num_pages=8, max_num_seqs=5, page_tokens=3, logical_pages=8,
                    max_num_batched_tokens=3, n=2)
    st_ = engine.run(_reqs([13, 8], 5), check=True).stats
    assert st_["preemptions"] == 3 and st_["recomputes"] == 3
    assert st_["tokens_recomputed"] > 0


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


@settings(max_examples=60, deadline=None)
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
