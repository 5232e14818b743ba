"""Guarded plan buffers (docs/DESIGN.md, "The plan", "Plan buffer guards"): every write into a
plan buffer checks its capacity first, in release builds too.  A plan that would overrun a
buffer -- a broken invariant of the scheduler, forced here by the test hook that narrows the
capacity a guard checks -- fails its step with a SystemError naming the buffer: nothing is
written past the buffer, nothing is pending, and the scheduler goes on exactly as after a
discarded plan."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers.ctypes_abi import EXECUTE_STEP, c_array, step_capsule
from helpers.step_checks import assert_same_plan

import qualia
from qualia import StepError, _core

KEY = b"g" * 16


def make(**kw):
    kw.setdefault("cache_key", KEY)
    kw.setdefault("max_num_batched_tokens", 64)
    return qualia.StepScheduler(kw.pop("num_pages", 64), 4, kw.pop("logical_pages", 16),
                                kw.pop("max_num_seqs", 4), **kw)


def ids(plan):
    return np.array([(int(plan.input_ids[r]) * 7 + 3) % 50 for r in plan.logits_indices],
                    dtype=np.uint32)


def step(s):
    plan = s.schedule()
    s.update(ids(plan))
    return plan


def snapshot(s):
    reqs = s.requests()
    return {"requests": reqs, "tokens": {r: s.request_tokens(r).tolist() for r in reqs},
            "waiting": s.num_waiting, "running": s.num_running, "stats": s.stats(),
            "refcounts": s.pool.refcounts().tolist(), "cache": s.cache_stats()}


# Each scenario: (buffer, narrowed capacity, setup calls, kwargs, where) such that the next
# schedule() writes one more record into `buffer` than the narrowed capacity allows; `where`:
# "lowering" (the guard fires once every request is scheduled, while the plan's arrays are
# written) or "scheduling" (it fires while requests are being scheduled, after earlier ones).
def prompt(n, base=0):
    return list(range(base + 1, base + 1 + n))


def two_requests(s):
    s.add_request(1, prompt(5), max_new_tokens=4)
    s.add_request(2, prompt(5, 100), max_new_tokens=4)


def one_long_prompt(s):
    s.add_request(1, prompt(40), max_new_tokens=4)    # a 40-token chunk


def an_n_group(s):
    s.add_request(1, prompt(6), max_new_tokens=4, n=3)  # 3 sampled rows at its last chunk


def an_aborted_request(s):
    two_requests(s)
    step(s)
    s.abort(2)                                          # named by the next plan


def a_fork(s):
    # forked in the middle of a page at update: the children are named by the next plan, and
    # the next decode of a member copies the shared page
    s.add_request(1, prompt(6), max_new_tokens=4, n=2)
    step(s)


def a_preemption(s):
    # 6 pages of 4 tokens: the two requests outgrow them at the sixth step, which preempts one
    s.add_request(1, prompt(8), max_new_tokens=12)
    s.add_request(2, prompt(8, 100), max_new_tokens=12)
    for _ in range(5):
        step(s)


SCENARIOS = {
    "per-token": ("per-token", 39, one_long_prompt, {}, "lowering"),
    "sampled-row": ("sampled-row", 2, an_n_group, {}, "lowering"),
    "finished_request_ids": ("finished_request_ids", 0, an_aborted_request, {}, "lowering"),
    "fork id": ("fork id", 0, a_fork, {}, "lowering"),
    "copies": ("copies", 0, a_fork, {}, "lowering"),
    "per-request": ("per-request", 1, two_requests, {}, "scheduling"),
    "new_request_ids": ("new_request_ids", 1, two_requests, {}, "scheduling"),
    "preempted_request_ids": ("preempted_request_ids", 0, a_preemption, {"num_pages": 6},
                              "scheduling"),
}


def outputs(s, finished):
    while s.has_unfinished():
        finished.extend(s.update(ids(s.schedule())))
    return repr(sorted(finished, key=lambda f: f.request_id))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_plan_that_would_overrun_a_buffer_fails_its_step_with_nothing_pending(name):
    buffer, cap, setup, kw, where = SCENARIOS[name]
    s, ref = make(**kw), make(**kw)
    setup(s)
    setup(ref)
    assert s._debug_plan_capacity(buffer, cap) == cap
    with pytest.raises(SystemError, match=f"overrun its {buffer} buffer .capacity {cap}.") as ei:
        s.schedule()
    assert "qualia internal error" in str(ei.value)
    # nothing pending: no plan to update, nothing advanced
    with pytest.raises(StepError.NoPlan):
        s.update([])
    assert {r: s.request_tokens(r).tolist() for r in s.requests()} == \
        {r: ref.request_tokens(r).tolist() for r in ref.requests()}
    if where == "lowering":
        # every request was scheduled before the guard fired: the state is the reference's
        # after it planned the same step and discarded it, and so are the next plans
        ref.schedule()
        ref.discard_plan()
        assert snapshot(s) == snapshot(ref)
        assert s._debug_plan_capacity(buffer) > cap
        while ref.has_unfinished():
            a, b = s.schedule(), ref.schedule()
            assert_same_plan(a, b)
            assert repr(s.update(ids(a))) == repr(ref.update(ids(b)))
    else:
        # the requests scheduled before it keep their pages, as after a discarded plan; with
        # the buffer back, every request finishes with the reference's tokens
        assert s._debug_plan_capacity(buffer) > cap
        assert outputs(s, []) == outputs(ref, [])
    assert not s.has_unfinished()
    assert s.stats()["free_pages"] == ref.stats()["free_pages"] == s.stats()["num_pages"]
    assert s.pool.refcounts().tolist() == ref.pool.refcounts().tolist()


def test_the_scenarios_write_the_buffer_they_narrow():
    # without the narrowed capacity each scenario's plan writes more than that many records
    # into its buffer (so the guard above fires for the reason it exists)
    counts = {"per-token": lambda p: len(p.input_ids),
              "per-request": lambda p: len(p.request_ids),
              "sampled-row": lambda p: len(p.logits_indices),
              "new_request_ids": lambda p: len(p.new_request_ids),
              "finished_request_ids": lambda p: len(p.finished_request_ids),
              "fork id": lambda p: len(p.fork_child_ids),
              "copies": lambda p: len(p.copies),
              "preempted_request_ids": lambda p: len(p.preempted_request_ids)}
    for name, (buffer, cap, setup, kw, _) in SCENARIOS.items():
        s = make(**kw)
        setup(s)
        assert counts[buffer](s.schedule()) > cap, name


def test_run_with_a_c_backend_reports_an_overrun_and_stops_with_nothing_pending():
    s, ref = make(), make()
    for x in (s, ref):
        x.add_request(1, prompt(40), max_new_tokens=3)
        x.add_request(2, prompt(5, 100), max_new_tokens=3)
    s._debug_plan_capacity("per-token", 44)
    with pytest.raises(SystemError, match="overrun its per-token buffer"):
        s.run(qualia.HashBackend())
    with pytest.raises(StepError.NoPlan):
        s.update([])
    ref.schedule()
    ref.discard_plan()
    assert snapshot(s) == snapshot(ref)
    s._debug_plan_capacity("per-token")
    got = s.run(qualia.HashBackend())
    want = ref.run(qualia.HashBackend())
    assert [(f.request_id, f.output_tokens.tolist()) for f in got.finished] == \
        [(f.request_id, f.output_tokens.tolist()) for f in want.finished]


def test_the_capacity_hook_only_narrows_what_was_allocated():
    s = make()
    with pytest.raises(ValueError, match="holds 64 records"):
        s._debug_plan_capacity("per-token", 65)
    with pytest.raises(ValueError, match="buffer must be one of"):
        s._debug_plan_capacity("input_ids", 1)
    assert s._debug_plan_capacity("per-token") == 64


def test_a_csr_form_that_would_overrun_kv_indices_fails_its_read_and_the_plan_stays_pending():
    # the CSR form is built on request (first read): its guard fires there
    s, ref = make(), make()
    two_requests(s)
    two_requests(ref)
    s._debug_plan_capacity("kv_indices", 1)
    plan = s.schedule()
    with pytest.raises(SystemError, match="overrun its kv_indices buffer .capacity 1."):
        _ = plan.kv_indices
    with pytest.raises(SystemError):
        _ = plan.kv_indptr
    # a backend that fails on it discards the plan: as the reference's discarded plan
    s.discard_plan()
    ref.schedule()
    ref.discard_plan()
    assert snapshot(s) == snapshot(ref)
    s._debug_plan_capacity("kv_indices")
    while ref.has_unfinished():
        a, b = s.schedule(), ref.schedule()
        assert_same_plan(a, b)
        assert repr(s.update(ids(a))) == repr(ref.update(ids(b)))


def sampling_capsule(flags):
    @EXECUTE_STEP
    def execute(ctx, p, out, logprobs):
        c = p.contents
        tokens = c_array(ctypes.c_uint32, c.input_ids, c.num_tokens)
        arr = (ctypes.c_uint32 * max(c.num_sampled, 1)).from_address(out)
        for r, t in enumerate(c_array(ctypes.c_int32, c.logits_indices, c.num_sampled)):
            arr[r] = (tokens[t] * 7 + 3) % 50
        return 0

    class Backend:
        __qualia_step_backend__ = step_capsule(execute, flags)
    return Backend()


def test_run_stops_at_a_csr_overrun_only_for_a_backend_that_reads_the_csr_form():
    s, ref = make(), make()
    two_requests(s)
    two_requests(ref)
    s._debug_plan_capacity("kv_indices", 1)
    with pytest.raises(SystemError, match="overrun its kv_indices buffer"):
        s.run(sampling_capsule(0))
    with pytest.raises(StepError.NoPlan):
        s.update([])
    ref.schedule()
    ref.discard_plan()
    assert snapshot(s) == snapshot(ref)
    # a backend that declares QUALIA_STEP_NO_CSR never has the form built
    got = s.run(sampling_capsule(_core.STEP_NO_CSR))
    want = ref.run(sampling_capsule(0))
    assert repr(got.finished) == repr(want.finished)
