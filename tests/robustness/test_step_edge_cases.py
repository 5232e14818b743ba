"""Edge cases of the engine step (docs/DESIGN.md, "The engine step", "Ownership"): negative
priorities in the twin, the ownership rule on every step entry point and on the manual verbs'
"step requests exist" check, run()'s failure reporting the requests it finished, the int32
limits of the plan arrays, and bad input of every kind changing nothing.  Each test runs the
compiled core and, where the rule is the twin's too, the pure-Python twin."""

from __future__ import annotations

import ctypes
import gc
import threading
import time

import numpy as np
import pytest
from helpers.ctypes_abi import EXECUTE_STEP, step_capsule
from helpers.step_checks import state_snapshot

import qualia
from qualia import BusyError, StepError
from qualia.twin import StepScheduler

I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def make(*args, twin=False, **kw):
    kw.setdefault("cache_key", b"h" * 16)
    return (StepScheduler if twin else qualia.StepScheduler)(*args, **kw)


def both_kinds(*args, **kw):
    return [make(*args, **kw), make(*args, twin=True, **kw)]


def sample(plan, vocab=50):
    return np.array([(int(plan.input_ids[r]) * 7 + 3) % vocab for r in plan.logits_indices],
                    dtype=np.uint32)


class Py:
    """A Python step backend with the sample rule above."""

    def execute_step(self, plan):
        return sample(plan)


# -- 1. priorities span int32 in the twin as in the core ----------------------------------------

@pytest.mark.parametrize("prio", [-1, -7, I32_MIN, I32_MAX])
def test_the_twin_accepts_every_int32_priority(prio):
    core, twin = both_kinds(32, 4, 8, 4)
    for s in (core, twin):
        s.add_request(1, [1, 2, 3], max_new_tokens=2, priority=0)
        s.add_request(2, [4, 5, 6], max_new_tokens=2, priority=prio)
    pc, pt = core.schedule(), twin.schedule()
    assert pc.request_ids.tolist() == pt.request_ids.tolist()


@pytest.mark.parametrize("prio, exc", [(I32_MIN - 1, OverflowError), (I32_MAX + 1, OverflowError),
                                       (True, TypeError), (1.0, TypeError)])
def test_priorities_outside_int32_are_refused_alike(prio, exc):
    for s in both_kinds(32, 4, 8, 4):
        before = state_snapshot(s)
        with pytest.raises(exc):
            s.add_request(1, [1], max_new_tokens=1, priority=prio)
        assert state_snapshot(s) == before


def test_negative_priorities_order_the_queue_alike():
    core, twin = both_kinds(32, 4, 8, 1, max_num_batched_tokens=3, max_queued=16)
    prios = [3, -2, I32_MIN, 0, -2, I32_MAX]
    for s in (core, twin):
        for rid, p in enumerate(prios):
            s.add_request(rid, [rid + 1, 9], max_new_tokens=1, priority=p)
    order = []
    for s in (core, twin):
        got = []
        while s.has_unfinished():
            plan = s.schedule()
            got += plan.new_request_ids.tolist()
            s.update(sample(plan))
        order.append(got)
    assert order[0] == order[1] == [2, 1, 4, 3, 0, 5]


# -- 2. the ownership rule: user code runs before the check, under no ownership ---------------

class Hook:
    """An integer whose __index__ runs ``fn`` once (and swallows what it raises)."""

    def __init__(self, value, fn):
        self.value, self.fn, self.done = value, fn, False

    def __index__(self):
        if not self.done:
            self.done = True
            try:
                self.fn()
            except Exception as exc:  # noqa: BLE001 - recorded
                self.error = exc
        return self.value


def test_update_resolves_its_ids_before_reading_the_plan():
    """A sampled id whose __index__ discards the plan and schedules a larger one: update must
    check the ids against the plan it applies (length mismatch), never apply stale ids."""
    for s in both_kinds(32, 4, 8, 4):
        s.add_request(1, [1, 2, 3], max_new_tokens=5)
        plan = s.schedule()
        assert len(plan.logits_indices) == 1

        def swap():
            s.discard_plan()
            s.add_request(2, [7, 8], max_new_tokens=5)
            s.schedule()
            swap.before = state_snapshot(s)
        with pytest.raises(ValueError):
            s.update([Hook(4, swap)])
        assert state_snapshot(s) == swap.before


def test_update_with_ids_that_abort_changes_nothing_wrong():
    """__index__ aborting a planned request before update owns: update skips it."""
    for s in both_kinds(32, 4, 8, 4):
        s.add_request(1, [1, 2, 3], max_new_tokens=5)
        s.add_request(2, [4, 5, 6], max_new_tokens=5)
        s.schedule()
        s.update([Hook(4, lambda: s.abort(1)), 5])
        assert state_snapshot(s)["requests"] == [2]
        assert s.request_tokens(2).tolist() == [4, 5, 6, 5]


def test_add_request_and_abort_hooks_change_nothing_on_error():
    for s in both_kinds(32, 4, 8, 4):
        s.add_request(1, [1, 2, 3], max_new_tokens=5)
        hook = Hook(1, lambda: s.schedule())    # the id resolves to a duplicate
        with pytest.raises(StepError.DuplicateRequest):
            s.add_request(hook, [1], max_new_tokens=1)
        before = state_snapshot(s)
        with pytest.raises(StepError.UnknownRequest):
            s.abort(Hook(9, lambda: None))
        assert state_snapshot(s) == before
        stops = iter([Hook(5, lambda: s.abort(1))])
        s.add_request(2, [1], max_new_tokens=1, stop_token_ids=stops)
        assert s.num_running == 0 and s.num_waiting == 1


@pytest.mark.parametrize("call", [
    lambda s: s.run(Py()),
    lambda s: s.schedule(),
    lambda s: s.update([1]),
    lambda s: s.abort(1),
    lambda s: s.add_request(9, [1], max_new_tokens=1),
    lambda s: s.discard_plan(),
])
def test_a_python_backend_calling_back_into_run_gets_busy_error(call):
    for s in both_kinds(32, 4, 8, 4):
        s.add_request(1, [1, 2, 3], max_new_tokens=3)
        seen = []

        class Reenter:
            def execute_step(self, plan):
                try:
                    call(s)
                except Exception as exc:  # noqa: BLE001 - recorded
                    seen.append(type(exc))
                return sample(plan)
        r = s.run(Reenter())
        assert seen and set(seen) == {BusyError}, seen
        assert [f.request_id for f in r.finished] == [1]
        assert len(r.finished[0].output_tokens) == 3


def test_sampled_ids_from_a_backend_run_their_code_while_owned():
    for s in both_kinds(32, 4, 8, 4):
        s.add_request(1, [1, 2, 3], max_new_tokens=2)
        errors = []

        class Sly:
            def execute_step(self, plan):
                def hit():
                    try:
                        s.abort(1)
                    except Exception as exc:  # noqa: BLE001 - recorded
                        errors.append(type(exc))
                return [Hook(int(x), hit) for x in sample(plan)]
        r = s.run(Sly())
        assert errors == [BusyError, BusyError]
        assert [f.request_id for f in r.finished] == [1]


def test_a_c_backend_calling_back_gets_busy_error():
    s = make(32, 4, 8, 4)
    s.add_request(1, [1, 2, 3], max_new_tokens=2)
    seen = []

    @EXECUTE_STEP
    def execute(ctx, plan, out, logprobs):
        try:
            s.add_request(2, [1], max_new_tokens=1)
        except Exception as exc:  # noqa: BLE001 - recorded
            seen.append(type(exc))
        p = plan.contents
        arr = (ctypes.c_uint32 * max(p.num_sampled, 1)).from_address(out)
        for i in range(p.num_sampled):
            arr[i] = 4
        return 0
    r = s.run(step_capsule(execute))
    assert seen == [BusyError, BusyError]
    assert [f.request_id for f in r.finished] == [1]


# -- 3. a failing run() reports what its earlier steps finished --------------------------------


def failing_workload(s):
    s.add_request(1, [1, 2], max_new_tokens=1)
    s.add_request(2, [3, 4], max_new_tokens=2)
    s.add_request(3, [5, 6], max_new_tokens=9)


def test_a_failing_python_backend_reports_the_requests_run_finished():
    for s in both_kinds(32, 4, 8, 4):
        failing_workload(s)
        calls = []

        class FailThird:
            def execute_step(self, plan):
                calls.append(1)
                if len(calls) == 3:
                    raise KeyError("boom")
                return sample(plan)
        with pytest.raises(KeyError) as info:
            s.run(FailThird())
        assert [(f.request_id, f.finish_reason) for f in info.value.finished] == \
            [(1, "length"), (2, "length")]
        assert len(info.value.finished[1].output_tokens) == 2
        r = s.run(Py())
        assert [f.request_id for f in r.finished] == [3]


def test_a_failing_c_backend_reports_the_requests_run_finished():
    s = make(32, 4, 8, 4)
    failing_workload(s)
    calls = []

    @EXECUTE_STEP
    def execute(ctx, plan, out, logprobs):
        calls.append(1)
        if len(calls) == 3:
            return -7
        p = plan.contents
        arr = (ctypes.c_uint32 * max(p.num_sampled, 1)).from_address(out)
        for i in range(p.num_sampled):
            arr[i] = 4
        return 0
    with pytest.raises(qualia.RaggedBackendError.Failed) as info:
        s.run(step_capsule(execute))
    assert [f.request_id for f in info.value.finished] == [1, 2]
    assert s.requests() == [3]


def test_a_c_backend_sampling_past_the_vocabulary_reports_what_finished():
    s = make(32, 4, 8, 4, vocab_size=10)
    failing_workload(s)
    calls = []

    @EXECUTE_STEP
    def execute(ctx, plan, out, logprobs):
        calls.append(1)
        p = plan.contents
        arr = (ctypes.c_uint32 * max(p.num_sampled, 1)).from_address(out)
        for i in range(p.num_sampled):
            arr[i] = 99 if len(calls) == 3 else 4
        return 0
    with pytest.raises(ValueError) as info:
        s.run(step_capsule(execute))
    assert [f.request_id for f in info.value.finished] == [1, 2]


# -- 4. the plan's int32 arrays bound the sizes --------------------------------------------------

@pytest.mark.parametrize("args, kw", [
    ((2**31 + 1, 1, 1, 1), {}),                                  # page ids
    ((4, 2**16, 2**15, 1), {}),                                  # positions: 2**31
    ((4, 4, 4, 1), {"max_num_batched_tokens": 2**31}),           # token offsets
])
def test_sizes_past_the_plans_int32_arrays_are_refused(args, kw):
    for twin in (False, True):
        with pytest.raises(ValueError, match="int32"):
            make(*args, twin=twin, **kw)


def test_the_largest_int32_sizes_are_accepted():
    pt, lp, budget = 2**16 - 1, 2**15, 2**31 - 1
    for twin in (False, True):
        s = make(4, pt, lp, 1, twin=twin, max_queued=1, max_num_batched_tokens=budget)
        f = s.facade if twin else s
        assert (f.num_pages, s.page_tokens, f.logical_pages, s.max_num_seqs, s.max_queued) == \
            (4, pt, lp, 1, 1)
        assert (s.budget if twin else s.max_num_batched_tokens) == budget
        # a plan at these sizes: one page of 65535 tokens, slots past 2**31 on the last page
        s.add_request(1, [1, 2, 3], max_new_tokens=1)
        plan = s.schedule()
        assert plan.page_tokens == pt and plan.positions.tolist() == [0, 1, 2]
        page = int(plan.kv_indices[0])
        assert plan.slot_mapping.tolist() == [page * pt + i for i in range(3)]


# -- bad input of every kind: a clear exception, nothing changed ---------------------------------

def pending(twin):
    s = make(16, 4, 8, 4, twin=twin, vocab_size=100, max_num_batched_tokens=8)
    s.add_request(1, [1, 2, 3], max_new_tokens=4)
    s.add_request(2, [4, 5], max_new_tokens=4, priority=-1)
    s.update(sample(s.schedule()))
    s.schedule()
    return s


U32 = np.array([1, 2], dtype=np.uint32)


@pytest.mark.parametrize("ids, exc", [
    (np.array([1, 2], dtype=np.uint32)[::-1][::1].copy()[None, :], ValueError),   # 2-D
    (np.array([1, 2, 3, 4], dtype=np.uint32)[::2], None),          # strided: accepted
    (np.array([1, 2], dtype=">u4"), None),                         # byte-swapped: accepted
    (np.array([True, False]), TypeError),                          # bool
    (np.array([1.0, np.nan]), TypeError),                          # NaN floats
    ([1, float("nan")], TypeError),
    ([1, 2**64], OverflowError),                                   # huge ints
    (np.array([1, 2**63], dtype=np.uint64), ValueError),
    (np.array([1, -2], dtype=np.int8), ValueError),
    ([1, True], TypeError),
    (bytearray(b"\x01\x02"), TypeError),
    (memoryview(U32), TypeError),
    ((ctypes.c_uint32 * 2)(1, 2), None),                           # ctypes array: its ints
    ((ctypes.c_uint32 * 3)(1, 2, 3), ValueError),                  # length mismatch
    (np.array([1, 2, 3], dtype=np.uint32), ValueError),
    (np.array([], dtype=np.uint32), ValueError),
    (np.array(["1", "2"]), TypeError),
    (np.array([1, 2], dtype=object), TypeError),
    (None, TypeError),
    (5, TypeError),
])
def test_bad_sampled_ids_change_nothing_alike(ids, exc):
    results = []
    for twin in (False, True):
        s = pending(twin)
        before = state_snapshot(s)
        if exc is None:
            s.update(ids)
            results.append(state_snapshot(s)["tokens"])
            continue
        with pytest.raises(exc):
            s.update(ids)
        assert state_snapshot(s) == before
        s.update([1, 2])       # the plan is still pending and applies
        results.append(state_snapshot(s)["tokens"])
    assert results[0] == results[1]


@pytest.mark.parametrize("prompt, exc", [
    (np.array([[1, 2]], dtype=np.uint32), (TypeError, ValueError)),
    (np.array([True, False]), TypeError),
    (np.array([1.0, np.nan]), TypeError),
    ([1, 2**32], OverflowError),
    ([1, -1], OverflowError),
    (np.array([1, -1], dtype=np.int64), (OverflowError, ValueError)),
    (bytearray(b"ab"), TypeError),
    (memoryview(U32), TypeError),
    (b"ab", TypeError),
    (None, TypeError),
    (object(), TypeError),
])
def test_bad_prompts_change_nothing_alike(prompt, exc):
    for twin in (False, True):
        s = pending(twin)
        before = state_snapshot(s)
        with pytest.raises(exc):
            s.add_request(9, prompt, max_new_tokens=1)
        assert state_snapshot(s) == before


@pytest.mark.parametrize("prompt", [
    np.array([1, 2, 3, 4], dtype=np.uint32)[::2],
    np.array([1, 3], dtype=">u4"),
    np.array([1, 3], dtype=np.int64),
    (ctypes.c_uint32 * 2)(1, 3),
    iter([1, 3]),
    range(1, 4, 2),
])
def test_prompts_of_every_accepted_form_agree(prompt):
    got = []
    for twin in (False, True):
        s = make(16, 4, 8, 4, twin=twin)
        p = iter([1, 3]) if isinstance(prompt, type(iter([]))) else prompt
        s.add_request(1, p, max_new_tokens=1)
        got.append(s.request_tokens(1).tolist())
    assert got == [[1, 3], [1, 3]]


def test_update_twice_and_schedule_twice_change_nothing():
    for twin in (False, True):
        s = pending(twin)
        before = state_snapshot(s)
        with pytest.raises(StepError.PlanPending):
            s.schedule()
        assert state_snapshot(s) == before
        s.update([1, 2])
        after = state_snapshot(s)
        with pytest.raises(StepError.NoPlan):
            s.update([1, 2])
        with pytest.raises(StepError.NoPlan):
            s.update("garbage")      # NoPlan is told first
        assert state_snapshot(s) == after


def test_abort_of_a_request_finished_in_that_update_and_id_reuse():
    for twin in (False, True):
        s = make(16, 4, 8, 4, twin=twin)
        s.add_request(1, [1, 2], max_new_tokens=1)
        s.schedule()
        done = s.update([3])
        assert [f.request_id for f in done] == [1]
        before = state_snapshot(s)
        with pytest.raises(StepError.UnknownRequest):
            s.abort(1)
        assert state_snapshot(s) == before
        # a finished id may be used again, and so may an aborted one
        s.add_request(1, [1, 2], max_new_tokens=1)
        s.abort(1)
        s.add_request(1, [5], max_new_tokens=1)
        plan = s.schedule()
        assert plan.finished_request_ids.tolist() == [1, 1]
        assert plan.request_ids.tolist() == [1]


def test_abort_during_a_pending_plan_then_update():
    for twin in (False, True):
        s = pending(twin)
        s.abort(1)
        s.abort(2)
        assert s.update([7, 8]) == []
        assert not s.has_unfinished()
        plan = s.schedule()
        assert sorted(plan.finished_request_ids.tolist()) == [1, 2]
        assert s.update([]) == []


def test_max_steps_zero_runs_nothing():
    for s in both_kinds(16, 4, 8, 4):
        s.add_request(1, [1, 2], max_new_tokens=2)
        before = state_snapshot(s)
        r = s.run(Py(), max_steps=0)
        assert len(r.stats) == 0 and r.finished == []
        assert state_snapshot(s) == before
        with pytest.raises(OverflowError):
            s.run(Py(), max_steps=-1)
        with pytest.raises(TypeError):
            s.run(Py(), max_steps=1.5)
        with pytest.raises(TypeError):
            s.run(object())
        assert state_snapshot(s) == before


def test_gc_callbacks_during_steps_get_busy_error_or_run_cleanly():
    s = make(32, 4, 8, 4)
    seen = []

    def cb(phase, info):
        if phase != "start":
            return
        try:
            s.abort(12345)
        except Exception as exc:  # noqa: BLE001 - recorded
            seen.append(type(exc))
    gc.callbacks.append(cb)
    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for rid in range(6):
            s.add_request(rid, [rid, 1, 2], max_new_tokens=3)
        r = s.run(Py())
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(cb)
    assert sorted(f.request_id for f in r.finished) == list(range(6))
    assert set(seen) <= {BusyError, StepError.UnknownRequest}
    assert s.free_pages == s.num_pages


def test_threads_racing_one_scheduler_neither_crash_nor_corrupt():
    s = make(64, 4, 8, 8, max_queued=64)
    stop = threading.Event()
    errors = []

    def adder():
        rid = 1000
        while not stop.is_set():
            rid += 1
            try:
                s.add_request(rid, [rid % 50, 1, 2], max_new_tokens=2)
            except (BusyError, StepError.QueueFull):
                pass
            except Exception as exc:  # noqa: BLE001 - recorded
                errors.append(exc)

    def aborter():
        k = 1000
        while not stop.is_set():
            k += 1
            try:
                s.abort(k)
            except (BusyError, StepError.UnknownRequest):
                pass
            except Exception as exc:  # noqa: BLE001 - recorded
                errors.append(exc)

    def stepper():
        for _ in range(300):
            try:
                plan = s.schedule()
            except (BusyError, StepError.PlanPending):
                continue
            ids = sample(plan)
            while True:
                try:
                    s.update(ids)
                    break
                except BusyError:
                    continue
                except Exception as exc:  # noqa: BLE001 - recorded
                    errors.append(exc)
                    break
        stop.set()

    def runner():
        # run() owns the scheduler for the whole call, and without the GIL for most of it: a
        # runner that called it again at once would leave the other threads only the moment
        # between two calls (a slow build under load starved the stepper for half an hour),
        # so it pauses between calls, with the scheduler free and the GIL released
        while not stop.is_set():
            try:
                s.run(qualia.HashBackend(vocab=50), max_steps=5)
            except (BusyError, StepError.PlanPending):
                pass
            except Exception as exc:  # noqa: BLE001 - recorded
                errors.append(exc)
            time.sleep(0.001)

    threads = [threading.Thread(target=f) for f in (adder, aborter, stepper, runner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    if s.num_waiting + s.num_running:
        try:
            s.discard_plan()
        except Exception:  # noqa: BLE001
            pass
        s.run(qualia.HashBackend(vocab=50))
    assert not s.has_unfinished()
    assert s.free_pages == s.num_pages


@pytest.mark.parametrize("stops, exc", [
    (bytearray(b"\x01"), TypeError), (memoryview(U32), TypeError), ("ab", TypeError),
    ([1, -1], OverflowError), ([2**32], OverflowError), (list(range(17)), ValueError),
    (5, TypeError), ([1.5], TypeError),
])
def test_bad_stop_token_ids_change_nothing_alike(stops, exc):
    for twin in (False, True):
        s = pending(twin)
        before = state_snapshot(s)
        with pytest.raises(exc):
            s.add_request(9, [1], max_new_tokens=1, stop_token_ids=stops)
        assert state_snapshot(s) == before


@pytest.mark.parametrize("then", ["update", "discard"])
def test_an_abort_keeps_the_pending_plans_block_table_row_until_the_plan_is_done(then):
    """A kernel executing the plan reads the aborted request's row: it keeps its pages (not -1)
    until update() or discard_plan(); the next plan lists the cleared row as changed."""
    rows = []
    for s in both_kinds(32, 4, 8, 4):
        s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=3)
        s.add_request(2, [6, 7, 8], max_new_tokens=3)
        plan = s.schedule()
        row = int(plan.block_table_rows[0])
        pages = plan.kv_indices[plan.kv_indptr[0]:plan.kv_indptr[1]].tolist()
        s.abort(1)
        assert plan.block_table[row, :len(pages)].tolist() == pages
        if then == "update":
            s.update([4, 4][:len(plan.logits_indices) ])
        else:
            s.discard_plan()
        assert (plan.block_table[row] == -1).all()
        nxt = s.schedule()
        assert row in nxt.changed_rows.tolist()
        rows.append((nxt.changed_rows.tolist(), nxt.block_table.tolist(),
                     nxt.finished_request_ids.tolist()))
    assert rows[0] == rows[1]


def test_a_discarded_plan_reports_its_changed_rows_and_finished_ids_again():
    """A backend that failed may not have applied the plan's row changes or finished ids: the
    next plan lists them again (a discard with no plan pending changes nothing)."""
    got = []
    for s in both_kinds(32, 4, 8, 4):
        s.add_request(1, [1, 2], max_new_tokens=1)
        s.schedule()
        s.update([3])                      # 1 finished
        s.add_request(2, [4, 5, 6], max_new_tokens=2)
        s.add_request(3, [7], max_new_tokens=2)
        p1 = s.schedule()
        first = (p1.changed_rows.tolist(), p1.finished_request_ids.tolist())
        assert first == ([0, 1], [1])
        s.abort(3)                         # aborted after the plan: reported after ours
        s.discard_plan()
        s.discard_plan()                   # nothing pending: a no-op
        p2 = s.schedule()
        assert p2.changed_rows.tolist() == [0, 1]
        assert p2.finished_request_ids.tolist() == [1, 3]
        s.update(sample(p2))
        p3 = s.schedule()
        assert p3.finished_request_ids.tolist() == []
        got.append((p2.block_table.tolist(), p3.changed_rows.tolist()))
    assert got[0] == got[1]


@pytest.mark.parametrize("bad, exc", [
    (lambda plan: sample(plan)[:-1], ValueError),            # one id short
    (lambda plan: sample(plan).astype(np.float32), TypeError),
    (lambda plan: [99] * len(plan.logits_indices), ValueError),   # past vocab_size
    (lambda plan: "ab", TypeError),
    (lambda plan: None, TypeError),
])
def test_bad_ids_from_a_python_backend_discard_the_step_and_report_what_finished(bad, exc):
    results = []
    for s in both_kinds(32, 4, 8, 4, vocab_size=50):
        failing_workload(s)
        calls = []

        class Bad:
            def execute_step(self, plan):
                calls.append(1)
                return bad(plan) if len(calls) == 3 else sample(plan)
        with pytest.raises(exc) as info:
            s.run(Bad())
        before = state_snapshot(s)
        assert [f.request_id for f in info.value.finished] == [1, 2]
        r = s.run(Py())
        assert before["requests"] == [3]
        results.append([(f.request_id, f.output_tokens.tolist()) for f in r.finished])
    assert results[0] == results[1]


# -- the pool a StepScheduler lends ----------------------------------------------------------------


def test_the_step_schedulers_pool_refuses_changes_for_its_whole_life():
    """s.pool changed behind the step would corrupt its pages (a raw release once made later
    plans list a page twice): the pool is the scheduler's for its whole life, queued requests
    or not -- its mutating calls raise BusyError and change nothing, its reads work."""
    s = qualia.StepScheduler(32, 4, 8, 4)
    pool = s.pool
    with pytest.raises(qualia.BusyError):
        pool.allocate()                             # before any request
    s.add_request(1, list(range(1, 10)), max_new_tokens=3)
    plan = s.schedule()
    page = int(plan.kv_indices[0])
    s.update([5] * len(plan.logits_indices))
    before = (pool.refcount(page), s.stats()["free_pages"], pool.refcounts().tolist())
    for call in (lambda: pool.release(page), lambda: pool.allocate(), lambda: pool.retain(page),
                 lambda: pool._debug_set_refcount(page, 3),
                 lambda: qualia.SequenceBlockTable(4).ensure_writable(0, pool)):
        with pytest.raises(qualia.BusyError):
            call()
    assert (pool.refcount(page), s.stats()["free_pages"], pool.refcounts().tolist()) == before
    result = s.run(qualia.HashBackend())            # the scheduler's own calls are unaffected
    assert [f.request_id for f in result.finished] == [1]
    with pytest.raises(qualia.BusyError):
        pool.allocate()                             # idle: still the scheduler's


def test_a_pool_outliving_its_step_scheduler_is_free():
    s = qualia.StepScheduler(32, 4, 8, 4)
    s.add_request(1, [1, 2, 3], max_new_tokens=2)
    pool = s.pool
    with pytest.raises(qualia.BusyError):
        pool.allocate()
    held, free = pool.refcounts().tolist(), pool.free_count
    del s
    gc.collect()
    page = pool.allocate()                          # no BusyError: the pool is nobody's now
    assert held[page] == 0 and pool.refcount(page) == 1 and pool.free_count == free - 1
    pool.release(page)
    assert pool.refcounts().tolist() == held and pool.free_count == free


# -- 5. 0xFFFFFFFF is no token id, whichever way a sampled id comes ------------------------------

@pytest.mark.parametrize("twin", [False, True], ids=["core", "twin"])
def test_update_refuses_the_id_that_is_no_token_without_a_vocabulary(twin):
    s = make(32, 4, 8, 4, twin=twin)
    s.add_request(1, [1, 2, 3], max_new_tokens=4)
    s.schedule()
    before = state_snapshot(s)
    for ids in ([2**32 - 1], np.array([2**32 - 1], np.uint32)):
        with pytest.raises(ValueError, match=r"outside \[0, 4294967294\]"):
            s.update(ids)
        assert state_snapshot(s) == before
    s.update([2**32 - 2])       # the largest token id
    assert s.schedule().input_ids.tolist() == [2**32 - 2]


@pytest.mark.parametrize("twin", [False, True], ids=["core", "twin"])
def test_run_with_a_python_backend_refuses_the_id_that_is_no_token(twin):
    s = make(32, 4, 8, 4, twin=twin)
    s.add_request(1, [1, 2, 3], max_new_tokens=4)

    class Backend:
        def execute_step(self, plan):
            return np.full(len(plan.logits_indices), 2**32 - 1, np.uint32)
    with pytest.raises(ValueError, match="4294967294"):
        s.run(Backend())
    assert s.requests() == [1]


@pytest.mark.parametrize("twin", [False, True], ids=["core", "twin"])
def test_a_beam_candidate_that_is_no_token_is_refused(twin):
    s = make(64, 4, 8, 8, twin=twin)
    s.add_request(1, [1, 2, 3], max_new_tokens=4, beam_width=2)
    plan = s.schedule()
    m, k = len(plan.logits_indices), plan.num_topk
    ids = np.tile(np.arange(k, dtype=np.uint32), (m, 1))
    ids[0, 1] = 2**32 - 1
    lps = np.tile(-np.arange(1, k + 1, dtype=np.float64), (m, 1))
    with pytest.raises(ValueError, match="topk token id"):
        s.update(ids[:, 0].copy(), ids, lps)


# -- 6. a backend's attribute that raises AttributeError is an error, not an absence ------------

class _Raises:
    def __init__(self, boom):
        self.boom = boom


def _backend_raising_in(name):
    def get(self):
        raise AttributeError(self.boom)

    def execute_step(self, plan):
        return np.zeros(len(plan.logits_indices), np.uint32)
    attrs = {"execute_step": execute_step, name: property(get)}
    return type("Backend", (_Raises,), attrs)("the attribute's own error")


@pytest.mark.parametrize("name, twin", [("__qualia_step_backend__", False),
                                        ("execute_step", False), ("execute_step", True)])
def test_a_backend_property_raising_attribute_error_is_raised_not_taken_for_absent(name, twin):
    # (the twin takes Python backends only)
    s = make(32, 4, 8, 4, twin=twin)
    s.add_request(1, [1, 2, 3], max_new_tokens=2)
    with pytest.raises(AttributeError, match="the attribute's own error"):
        s.run(_backend_raising_in(name))
    assert s.requests() == [1]


def test_a_backend_whose_getattr_raises_attribute_error_has_no_such_attribute():
    class Backend:
        def __getattr__(self, name):
            raise AttributeError(name)

        def execute_step(self, plan):
            return np.zeros(len(plan.logits_indices), np.uint32)
    s = make(32, 4, 8, 4)
    s.add_request(1, [1, 2, 3], max_new_tokens=2)
    s.run(Backend())
    assert s.requests() == []


@pytest.mark.parametrize("vocab, bad", [(None, 2**32 - 1), (100, 100)])
@pytest.mark.parametrize("twin", [False, True], ids=["core", "twin"])
def test_an_end_or_stop_id_no_sampled_token_can_match_is_refused(twin, vocab, bad):
    s = make(32, 4, 8, 4, twin=twin, vocab_size=vocab)
    for kw in ({"eos_token_id": bad}, {"stop_token_ids": [3, bad]}):
        with pytest.raises(ValueError, match="no sampled token can match it"):
            s.add_request(1, [1, 2, 3], max_new_tokens=2, **kw)
        assert s.requests() == []
    s.add_request(1, [1, 2, 3], max_new_tokens=2, eos_token_id=bad - 1, stop_token_ids=[bad - 1])
    assert s.requests() == [1]
