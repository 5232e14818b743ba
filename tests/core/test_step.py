"""The engine step of the compiled core (``qualia.StepScheduler``: add_request / abort / schedule /
update / run), one test per rule of docs/DESIGN.md, "The engine step".  Where a rule is about the
plan, the test also checks the pure-Python twin (``qualia.twin.StepScheduler``) gives the
same plan; tests/differential/test_step_vs_twin.py drives both at random."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.step_checks import PLAN_ARRAYS, assert_same_plan

import qualia
from qualia import StepError
from qualia.twin import StepScheduler


def make(*args, twin=False, **kw):
    kw.setdefault("cache_key", b"k" * 16)
    cls = StepScheduler if twin else qualia.StepScheduler
    return cls(*args, **kw)


def pair(*args, **kw):
    return make(*args, **kw), make(*args, twin=True, **kw)


def next_token(token, position):
    return (int(token) * 31 + int(position) * 7 + 1) % 100


def sample(plan):
    return np.array([next_token(plan.input_ids[r], plan.positions[r])
                     for r in plan.logits_indices], dtype=np.uint32)


def both(a, b, fn):
    """Call fn on both schedulers; the same exception type or the same result."""
    out = []
    for s in (a, b):
        try:
            out.append(("ok", fn(s)))
        except Exception as exc:  # noqa: BLE001 - compared below
            out.append(("err", type(exc)))
    assert out[0][0] == out[1][0], out
    if out[0][0] == "err":
        assert out[0][1] is out[1][1], out
    return out[0][1]


def bounded(s, limit=2000):
    """One iteration per step while ``s`` has unfinished requests; past ``limit`` steps the test
    fails (a scheduler that stops making progress fails it instead of hanging it)."""
    for k in range(limit):
        if not s.has_unfinished():
            return
        yield k
    raise AssertionError(f"requests unfinished after {limit} steps")


def step_both(a, b):
    pa, pb = a.schedule(), b.schedule()
    assert_same_plan(pa, pb)
    ids = sample(pa)
    fa, fb = a.update(ids), b.update(ids)
    assert [(f.request_id, f.output_tokens.tolist(), f.finish_reason) for f in fa] == \
        [(f.request_id, f.output_tokens.tolist(), f.finish_reason) for f in fb]
    return pa, fa


def snapshot(s):
    """Everything a failed call must leave as it was."""
    reqs = s.requests()
    return {
        "requests": reqs,
        "tokens": {r: s.request_tokens(r).tolist() for r in reqs},
        "waiting": s.num_waiting,
        "running": s.num_running,
        "unfinished": s.has_unfinished(),
        "free": s.free_pages,
        "refcounts": s.pool.refcounts().tolist(),
        "cache": s.cache_stats(),
        "stats": s.stats(),
        "reclaimable": s.reclaimable_pages().tolist(),
    }


# -- ordering ------------------------------------------------------------------------------------

def test_plan_order_is_decodes_then_prefills_then_admissions():
    a, b = pair(64, 4, 16, 4, max_num_batched_tokens=12, max_prefill_chunk=4)
    for s in (a, b):
        s.add_request(1, list(range(1, 3)), max_new_tokens=5)    # 2 tokens: decodes soon
        s.add_request(2, list(range(10, 22)), max_new_tokens=5)  # 12 tokens: 3 chunks
    step_both(a, b)       # 1 prefills whole (2), 2 takes a chunk of 4
    for s in (a, b):
        s.add_request(3, [7, 8, 9], max_new_tokens=2)
    plan, _ = step_both(a, b)
    assert plan.request_ids.tolist() == [1, 2, 3]
    assert plan.num_decode_tokens == 1
    assert plan.new_request_ids.tolist() == [3]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    a, b = pair(64, 4, 16, 4, max_num_batched_tokens=64)
    for s in (a, b):
        s.add_request(10, [1, 2], max_new_tokens=1, priority=2)
        s.add_request(11, [3, 4], max_new_tokens=1, priority=0)
        s.add_request(12, [5, 6], max_new_tokens=1, priority=2)
        s.add_request(13, [7, 8], max_new_tokens=1, priority=0)
    plan, _ = step_both(a, b)
    assert plan.new_request_ids.tolist() == [11, 13, 10, 12]


def test_negative_priorities_come_first():
    # (core only: the twin's integer helper refuses negative values)
    s = make(64, 4, 16, 4, max_num_batched_tokens=64)
    s.add_request(1, [1], max_new_tokens=1, priority=0)
    s.add_request(2, [2], max_new_tokens=1, priority=-5)
    s.add_request(3, [3], max_new_tokens=1, priority=-(2**31))
    assert s.schedule().new_request_ids.tolist() == [3, 2, 1]


def test_the_first_waiting_request_that_does_not_fit_stops_admissions():
    a, b = pair(64, 4, 16, 4, max_num_batched_tokens=6)
    for s in (a, b):
        s.add_request(1, [1, 2, 3, 4], max_new_tokens=1)
        s.add_request(2, [1] * 10, max_new_tokens=1)   # chunked: takes the rest of the budget
        s.add_request(3, [5], max_new_tokens=1)
    plan, _ = step_both(a, b)
    assert plan.request_ids.tolist() == [1, 2]
    assert np.diff(plan.query_start_loc).tolist() == [4, 2]


# -- budget, max_num_seqs, chunking --------------------------------------------------------------

def test_token_budget_bounds_every_plan():
    a, b = pair(200, 4, 16, 8, max_num_batched_tokens=7)
    for s in (a, b):
        for i in range(6):
            s.add_request(i, list(range(i, i + 9)), max_new_tokens=4)
    for _ in bounded(a):
        plan, _ = step_both(a, b)
        assert plan.num_tokens <= 7
        assert plan.num_tokens == plan.num_prefill_tokens + plan.num_decode_tokens


def test_max_num_seqs_bounds_running_requests():
    a, b = pair(200, 4, 16, 3, max_num_batched_tokens=100, max_queued=32)
    for s in (a, b):
        for i in range(6):
            s.add_request(i, [i + 1] * 3, max_new_tokens=3)
    for _ in bounded(a):
        plan, _ = step_both(a, b)
        assert plan.num_seqs <= 3
        assert a.num_running <= 3


def test_long_prompts_are_chunked_and_sampled_only_at_their_last_chunk():
    a, b = pair(64, 4, 16, 2, max_num_batched_tokens=100, max_prefill_chunk=5)
    for s in (a, b):
        s.add_request(1, list(range(1, 13)), max_new_tokens=2)
    chunks = []
    for _ in bounded(a):
        plan, _ = step_both(a, b)
        chunks.append((plan.positions.tolist(), plan.logits_indices.tolist()))
    assert chunks[0] == ([0, 1, 2, 3, 4], [])
    assert chunks[1] == ([5, 6, 7, 8, 9], [])
    assert chunks[2] == ([10, 11], [1])
    assert chunks[3] == ([12], [0])


# -- preemption ----------------------------------------------------------------------------------

def test_preemption_picks_the_largest_priority_value_then_the_latest_admitted():
    # 6 pages of 4 tokens; three requests of 2 pages each, then decodes need a third page each
    a, b = pair(6, 4, 8, 4, max_num_batched_tokens=64)
    for s in (a, b):
        s.add_request(1, [1] * 8, max_new_tokens=8, priority=0)
        s.add_request(2, [2] * 8, max_new_tokens=8, priority=1)
        s.add_request(3, [3] * 8, max_new_tokens=8, priority=1)
    preempted = []
    for _ in bounded(a):
        plan, _ = step_both(a, b)
        preempted += plan.preempted_request_ids.tolist()
    # 3 (priority 1, admitted after 2) goes first
    assert preempted[0] == 3


@pytest.mark.parametrize("twin", [False, True])
def test_a_step_that_preempts_admits_nothing(twin):
    # 7 pages of 4 tokens, three 9-token prompts growing to 21: decodes run out of pages and
    # preempt; the pages a preemption frees go to the running requests, never to an admission
    # in the same step (which could take them back and preempt again, step after step)
    s = make(7, 4, 8, 4, max_num_batched_tokens=64, twin=twin)
    for i in range(3):
        s.add_request(i, [i + 1] * 9, max_new_tokens=12)
    preempting = 0
    for _ in bounded(s):
        plan = s.schedule()
        if len(plan.preempted_request_ids):
            preempting += 1
            assert len(plan.new_request_ids) == 0, (plan.preempted_request_ids.tolist(),
                                                    plan.new_request_ids.tolist())
        s.update(sample(plan))
    assert preempting > 0


def test_a_preempted_request_recomputes_and_generates_the_same_tokens():
    def outputs(num_blocks):
        s = make(num_blocks, 4, 8, 4, max_num_batched_tokens=64)
        for i in range(3):
            s.add_request(i, [i + 1] * 9, max_new_tokens=12)
        got, preempted = {}, 0
        for _ in bounded(s):
            plan = s.schedule()
            preempted += len(plan.preempted_request_ids)
            for f in s.update(sample(plan)):
                got[f.request_id] = f.output_tokens.tolist()
        assert s.free_pages == num_blocks
        return got, preempted
    roomy, none = outputs(64)
    tight, some = outputs(7)
    assert none == 0 and some > 0
    assert tight == roomy


def test_preempted_request_keeps_its_outputs_and_waits_again():
    a, b = pair(5, 4, 8, 4, max_num_batched_tokens=64)
    for s in (a, b):
        s.add_request(1, [1] * 8, max_new_tokens=10)
        s.add_request(2, [2] * 8, max_new_tokens=10)
    while True:
        plan, _ = step_both(a, b)
        if len(plan.preempted_request_ids):
            break
    victim = int(plan.preempted_request_ids[0])
    assert victim in a.requests()
    assert len(a.request_tokens(victim)) > 8          # its outputs stay
    assert a.num_waiting == 1


# -- prefix hits ---------------------------------------------------------------------------------

def test_an_admission_skips_the_cached_pages_of_its_tokens():
    a, b = pair(64, 4, 16, 4, max_num_batched_tokens=64)
    shared = list(range(100, 112))
    for s in (a, b):
        s.add_request(1, shared + [1, 2], max_new_tokens=1)
    step_both(a, b)                      # 1 finishes: its full pages stay cached
    for s in (a, b):
        s.add_request(2, shared + [3, 4, 5], max_new_tokens=1)
    plan, _ = step_both(a, b)
    assert plan.num_cached_tokens == 12
    assert plan.positions.tolist() == [12, 13, 14]
    assert plan.seq_lens.tolist() == [15]


def test_off_mode_has_no_hits_and_generates_the_same_tokens():
    def run(mode):
        s = make(64, 4, 16, 4, prefix_caching=mode, max_num_batched_tokens=8)
        for i in range(4):
            s.add_request(i, [9, 9, 9, 9, 9, 9, 9, 9, i], max_new_tokens=5)
        got, cached = {}, 0
        for _ in bounded(s):
            plan = s.schedule()
            cached += plan.num_cached_tokens
            for f in s.update(sample(plan)):
                got[f.request_id] = f.output_tokens.tolist()
        return got, cached
    off, off_cached = run("off")
    auto, auto_cached = run("auto")
    assert off == auto
    assert off_cached == 0 and auto_cached > 0


# -- rows, changed rows, CSR ---------------------------------------------------------------------

def test_rows_are_lowest_free_kept_while_running_and_cleared_when_done():
    a, b = pair(64, 4, 8, 4, max_num_batched_tokens=64)
    for s in (a, b):
        s.add_request(1, [1, 2, 3], max_new_tokens=1)
        s.add_request(2, [4, 5, 6], max_new_tokens=6)
    plan, done = step_both(a, b)
    assert plan.block_table_rows.tolist() == [0, 1]
    assert [f.request_id for f in done] == [1]
    for s in (a, b):
        s.add_request(3, [7], max_new_tokens=2)
    plan, _ = step_both(a, b)
    assert plan.changed_rows.tolist() == [0]          # row 0 cleared, then taken by 3
    assert plan.request_ids.tolist() == [2, 3]
    assert plan.block_table_rows.tolist() == [1, 0]
    row = plan.block_table[0]
    assert row[0] >= 0 and (row[1:] == -1).all()


def test_changed_rows_lists_only_rows_whose_pages_changed():
    a, b = pair(64, 4, 8, 2, max_num_batched_tokens=64)
    for s in (a, b):
        s.add_request(1, [1, 2], max_new_tokens=10)
    plan, _ = step_both(a, b)
    assert plan.changed_rows.tolist() == [0]
    plan, _ = step_both(a, b)               # position 2: same page
    assert plan.changed_rows.tolist() == []
    plan, _ = step_both(a, b)               # position 3: same page
    plan, _ = step_both(a, b)               # position 4: a new page
    assert plan.changed_rows.tolist() == [0]


def test_csr_form_matches_the_block_table_and_seq_lens():
    s = make(64, 4, 16, 4, max_num_batched_tokens=9, max_prefill_chunk=5)
    for i in range(4):
        s.add_request(i, list(range(i, i + 11)), max_new_tokens=6)
    for _ in bounded(s):
        plan = s.schedule()
        pt = plan.page_tokens
        for i in range(plan.num_seqs):
            row = plan.block_table[plan.block_table_rows[i]]
            k0, k1 = plan.kv_indptr[i], plan.kv_indptr[i + 1]
            assert k1 - k0 == -(-plan.seq_lens[i] // pt)
            assert plan.kv_indices[k0:k1].tolist() == row[:k1 - k0].tolist()
            assert plan.kv_last_page_len[i] == plan.seq_lens[i] - (k1 - k0 - 1) * pt
            for j in range(plan.query_start_loc[i], plan.query_start_loc[i + 1]):
                p = plan.positions[j]
                assert plan.slot_mapping[j] == row[p // pt] * pt + p % pt
        s.update(sample(plan))


def test_plan_arrays_are_read_only_views():
    s = make(16, 4, 8, 2)
    s.add_request(1, [1, 2, 3], max_new_tokens=2)
    plan = s.schedule()
    for name in PLAN_ARRAYS:
        arr = getattr(plan, name)
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr.flags.writeable = True
    assert plan.block_table.shape == (2, 8)


# -- stop conditions -----------------------------------------------------------------------------

def drive(s, tokens):
    """Feed `tokens` one per step to request 1 (a single request); return its finish."""
    for t in tokens:
        plan = s.schedule()
        done = s.update([t] * len(plan.logits_indices))
        if done:
            return done[0]
    return None


@pytest.mark.parametrize("kw, tokens, want", [
    ({"max_new_tokens": 3}, [5, 6, 7], ([5, 6, 7], "length")),
    ({"max_new_tokens": 9, "eos_token_id": 6}, [5, 6, 7], ([5, 6], "stop")),
    ({"max_new_tokens": 9, "eos_token_id": 6, "ignore_eos": True}, [5, 6, 7, 8],
     None),
    ({"max_new_tokens": 9, "stop_token_ids": [8, 7]}, [5, 6, 7], ([5, 6, 7], "stop")),
    ({"max_new_tokens": 9, "stop_token_ids": [7, 8]}, [5, 6, 7], ([5, 6, 7], "stop")),
    ({"max_new_tokens": 9, "stop_token_ids": [6]}, [5, 6, 7], ([5, 6], "stop")),
    ({"max_new_tokens": 2, "eos_token_id": 6}, [5, 6], ([5, 6], "length")),  # length first
])
def test_stop_conditions(kw, tokens, want):
    for twin in (False, True):
        s = make(16, 4, 8, 2, twin=twin)
        s.add_request(1, [1, 2], **kw)
        f = drive(s, tokens)
        if want is None:
            assert f is None and s.has_unfinished()
        else:
            assert (f.output_tokens.tolist(), f.finish_reason) == want
            assert f.output_tokens.dtype == np.uint32
            assert not s.has_unfinished()


# -- abort ---------------------------------------------------------------------------------------

def test_abort_a_waiting_request():
    a, b = pair(16, 4, 8, 1, max_queued=8)
    for s in (a, b):
        s.add_request(1, [1], max_new_tokens=3)
        s.add_request(2, [2], max_new_tokens=3)
        s.abort(2)
        assert s.num_waiting == 1
    plan, _ = step_both(a, b)
    assert plan.finished_request_ids.tolist() == [2]
    assert plan.request_ids.tolist() == [1]


def test_abort_a_running_request_between_plans():
    a, b = pair(16, 4, 8, 2)
    for s in (a, b):
        s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=3)
    step_both(a, b)
    free = a.free_pages
    for s in (a, b):
        s.abort(1)
        assert not s.has_unfinished()
    assert a.free_pages > free and a.free_pages == a.num_pages
    plan, _ = step_both(a, b)
    assert plan.finished_request_ids.tolist() == [1]
    assert plan.changed_rows.tolist() == [0]


def test_abort_a_request_in_the_pending_plan_skips_it_at_update():
    a, b = pair(16, 4, 8, 2)
    for s in (a, b):
        s.add_request(1, [1, 2], max_new_tokens=3)
        s.add_request(2, [3, 4], max_new_tokens=1)
    pa, _ = a.schedule(), b.schedule()
    for s in (a, b):
        s.abort(2)
    ids = sample(pa)
    assert len(ids) == 2                      # the aborted request's row is still there...
    fa, fb = a.update(ids), b.update(ids)
    assert fa == [] and fb == []              # ...and ignored
    assert a.requests() == list(b.requests()) == [1]
    assert a.request_tokens(1).tolist() == b.request_tokens(1).tolist()


def test_abort_unknown_or_finished_is_an_error():
    s = make(16, 4, 8, 2)
    with pytest.raises(StepError.UnknownRequest):
        s.abort(5)
    s.add_request(5, [1], max_new_tokens=1)
    s.update(sample(s.schedule()))
    with pytest.raises(StepError.UnknownRequest):
        s.abort(5)


# -- the loop ------------------------------------------------------------------------------------

def workload(s, n=16, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(n):
        prompt = rng.integers(0, 50, size=int(rng.integers(1, 30)), dtype=np.uint32)
        s.add_request(i, prompt, max_new_tokens=int(rng.integers(1, 20)),
                      priority=int(rng.integers(0, 2)))


def test_run_with_the_c_hash_backend_equals_a_python_loop():
    hb = qualia.HashBackend()
    a = make(14, 4, 16, 4, max_num_batched_tokens=16, max_prefill_chunk=6, max_queued=32)
    b = make(14, 4, 16, 4, max_num_batched_tokens=16, max_prefill_chunk=6, max_queued=32)
    workload(a)
    workload(b)
    result = a.run(hb)
    finished, steps = [], 0
    for _ in bounded(b):
        plan = b.schedule()
        finished += b.update(hb.execute_step(plan))
        steps += 1
    assert len(result.stats) == steps
    assert [(f.request_id, f.output_tokens.tolist(), f.finish_reason) for f in result.finished] \
        == [(f.request_id, f.output_tokens.tolist(), f.finish_reason) for f in finished]
    assert result.stats["num_preempted"].sum() > 0       # the pool is tight enough
    assert a.free_pages == a.num_pages


def test_run_with_a_python_backend_matches_the_twin_run():
    class Backend:
        def execute_step(self, plan):
            return sample(plan)
    a = make(14, 4, 16, 4, max_num_batched_tokens=16, max_queued=32)
    b = make(14, 4, 16, 4, max_num_batched_tokens=16, twin=True, max_queued=32)
    workload(a, seed=3)
    workload(b, seed=3)
    ra, rb = a.run(Backend()), b.run(Backend())
    assert ra.stats.dtype == qualia.STEP_STATS
    assert np.array_equal(ra.stats, rb.stats)
    assert [(f.request_id, f.output_tokens.tolist()) for f in ra.finished] == \
        [(f.request_id, f.output_tokens.tolist()) for f in rb.finished]


def test_run_c_backend_stats_match_the_python_backend_run():
    hb = qualia.HashBackend()

    class Py:
        def execute_step(self, plan):
            return hb.execute_step(plan)
    a = make(40, 4, 16, 4, max_num_batched_tokens=16, max_queued=32)
    b = make(40, 4, 16, 4, max_num_batched_tokens=16, max_queued=32)
    workload(a, seed=5)
    workload(b, seed=5)
    assert np.array_equal(a.run(hb).stats, b.run(Py()).stats)


def test_run_stops_after_max_steps():
    s = make(64, 4, 16, 4)
    workload(s, n=4)
    r = s.run(qualia.HashBackend(), max_steps=3)
    assert len(r.stats) == 3
    assert s.has_unfinished()
    rest = s.run(qualia.HashBackend())
    assert not s.has_unfinished()
    assert len(r.finished) + len(rest.finished) == 4


def test_a_failing_backend_discards_the_step():
    s = make(64, 4, 16, 4)
    s.add_request(1, [1, 2, 3], max_new_tokens=4)

    class Boom:
        def execute_step(self, plan):
            raise RuntimeError("boom")
    before = snapshot(s)
    with pytest.raises(RuntimeError):
        s.run(Boom())
    after = snapshot(s)
    # the reserved pages stay with the request; nothing advanced
    assert after["tokens"] == before["tokens"]
    r = s.run(qualia.HashBackend(fault=None))
    assert [f.request_id for f in r.finished] == [1]


def test_c_backend_failure_discards_the_step():
    s = make(64, 4, 16, 4)
    s.add_request(1, [1, 2, 3], max_new_tokens=4)
    with pytest.raises(qualia.RaggedBackendError):
        s.run(qualia.HashBackend(fault="error"))
    assert s.request_tokens(1).tolist() == [1, 2, 3]
    assert len(s.run(qualia.HashBackend()).finished) == 1


# -- bad input: a clear exception, nothing changed -----------------------------------------------

def busy_scheduler():
    s = make(12, 4, 8, 4, max_num_batched_tokens=6, max_queued=6, vocab_size=100)
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=6)
    s.add_request(2, [1, 2, 3, 4, 9], max_new_tokens=6, priority=1)
    s.add_request(3, [7], max_new_tokens=2)
    s.update(sample(s.schedule()))
    return s


@pytest.mark.parametrize("call, exc", [
    (lambda s: s.add_request(1, [1], max_new_tokens=1), StepError.DuplicateRequest),
    (lambda s: s.add_request(9, [], max_new_tokens=1), ValueError),
    (lambda s: s.add_request(9, [1], max_new_tokens=0), ValueError),
    (lambda s: s.add_request(9, [1] * 30, max_new_tokens=3), StepError.NeverFits),
    (lambda s: s.add_request(9, [1, -1], max_new_tokens=1), (OverflowError, ValueError)),
    (lambda s: s.add_request(9, [1, 2.5], max_new_tokens=1), TypeError),
    (lambda s: s.add_request(9, [1], max_new_tokens=1, stop_token_ids=range(17)), ValueError),
    (lambda s: s.add_request(9, [1], max_new_tokens=1, priority=2**40), OverflowError),
    (lambda s: s.add_request(9, "abc", max_new_tokens=1), TypeError),
    (lambda s: s.abort(99), StepError.UnknownRequest),
    (lambda s: s.update([1]), StepError.NoPlan),
    (lambda s: s.pool.allocate(), qualia.BusyError),      # the lent pool is the scheduler's
    (lambda s: s.pool.release(0), qualia.BusyError),
])
def test_bad_input_changes_nothing(call, exc):
    s = busy_scheduler()
    before = snapshot(s)
    with pytest.raises(exc):
        call(s)
    assert snapshot(s) == before


def test_never_fits_the_pool():
    s = make(3, 4, 8, 4)
    before = snapshot(s)
    with pytest.raises(StepError.NeverFits):
        s.add_request(1, [1] * 10, max_new_tokens=4)   # 13 positions need 4 pages
    assert snapshot(s) == before
    s.add_request(1, [1] * 9, max_new_tokens=4)          # 12 positions: 3 pages


def test_queue_full():
    s = busy_scheduler()
    for i in range(10, 13):
        s.add_request(i, [1], max_new_tokens=1)
    before = snapshot(s)
    with pytest.raises(StepError.QueueFull):
        s.add_request(20, [1], max_new_tokens=1)
    assert snapshot(s) == before


@pytest.mark.parametrize("ids, exc", [
    ([1], ValueError),                                         # wrong length
    ([1, 2, 3, 4], ValueError),
    (np.array([1.0, 2.0, 3.0]), TypeError),                    # float dtype
    ([1.0, 2.0, 3.0], TypeError),
    (np.array([1, 2, 100], dtype=np.uint32), ValueError),      # out of vocabulary
    ([1, 2, 100], ValueError),
    (np.array([1, 2, -1], dtype=np.int64), ValueError),
    (np.array([[1, 2, 3]], dtype=np.uint32), ValueError),      # 2-D
    ("abc", TypeError),
])
def test_bad_sampled_ids_change_nothing(ids, exc):
    s = busy_scheduler()
    plan = s.schedule()
    assert len(plan.logits_indices) == 3
    before = snapshot(s)
    with pytest.raises(exc):
        s.update(ids)
    assert snapshot(s) == before
    s.update(np.array([1, 2, 3], dtype=np.int64))   # the plan is still pending and applies


def test_schedule_while_a_plan_is_pending_changes_nothing():
    s = busy_scheduler()
    s.schedule()
    before = snapshot(s)
    with pytest.raises(StepError.PlanPending):
        s.schedule()
    assert snapshot(s) == before


@pytest.mark.parametrize("kw", [{"max_num_batched_tokens": 0}, {"max_num_seqs": 0},
                                {"max_prefill_chunk": 0}, {"vocab_size": 0},
                                {"max_num_seqs": 65537}, {"max_queued": 1, "max_num_seqs": 2}])
def test_zero_budgets_are_refused(kw):
    kw = {"max_num_seqs": 4, **kw}
    for twin in (False, True):
        with pytest.raises(ValueError):
            make(16, 4, 8, twin=twin, **kw)


def test_the_step_scheduler_has_no_explicit_prefix_mode():
    for twin in (False, True):
        with pytest.raises(ValueError, match="prefix_caching"):
            make(16, 4, 8, 2, twin=twin, prefix_caching="explicit")


def test_the_step_scheduler_and_the_facade_each_have_their_own_verbs():
    """qualia.StepScheduler has the engine step and no admit/decode/finish; qualia.Scheduler
    the admit/decode/finish facade and no engine step: neither can reach into the other's
    requests, so there is no mode to switch between."""
    step_verbs = {"add_request", "abort", "schedule", "update", "discard_plan", "run"}
    facade_verbs = {"admit", "reserve", "advance", "complete_prefill", "publish_prefix",
                    "decode", "finish", "fork", "evict", "evict_lru", "block_table"}
    for verb in step_verbs:
        assert callable(getattr(qualia.StepScheduler, verb))
        assert not hasattr(qualia.Scheduler, verb)
    for verb in facade_verbs:
        assert callable(getattr(qualia.Scheduler, verb))
        assert not hasattr(qualia.StepScheduler, verb)


def test_a_requests_pages_are_its_block_table_row_while_it_runs():
    """request_pages(): nothing while the request waits, the plan's block-table row of it while
    it runs (one page more per page_tokens tokens), UnknownRequest once it has finished."""
    for twin in (False, True):
        s = make(16, 4, 8, 2, twin=twin)
        s.add_request(1, list(range(1, 7)), max_new_tokens=3)
        assert s.request_pages(1).tolist() == []
        plan = s.schedule()
        pages = s.request_pages(1)
        assert pages.dtype == np.uint32 and len(pages) == 2
        row = plan.block_table[plan.block_table_rows[0]]
        assert row.tolist() == pages.tolist() + [-1] * 6
        s.update([9])
        while s.has_unfinished():
            s.schedule()
            s.update([9])
        with pytest.raises(StepError.UnknownRequest):
            s.request_pages(1)
        with pytest.raises(StepError.UnknownRequest):
            s.request_pages(7)


def test_add_request_from_numpy_and_from_a_list_agree():
    a, b = make(16, 4, 8, 2), make(16, 4, 8, 2)
    prompt = [5, 6, 7, 2**32 - 1]
    a.add_request(1, np.array(prompt, dtype=np.uint32), max_new_tokens=1)
    b.add_request(1, prompt, max_new_tokens=1)
    c = make(16, 4, 8, 2)
    c.add_request(1, iter(prompt), max_new_tokens=1)
    assert a.request_tokens(1).tolist() == b.request_tokens(1).tolist() == \
        c.request_tokens(1).tolist() == prompt


def test_many_aborts_between_plans_are_all_reported():
    # more aborts than the finished-id buffer was sized for: it grows (outside any step)
    s = make(64, 4, 8, 2, max_queued=4)
    rids = list(range(40))
    for rid in rids:
        s.add_request(rid, [1, 2], max_new_tokens=1)
        s.abort(rid)
    plan = s.schedule()
    assert plan.finished_request_ids.tolist() == rids


# -- pages of a pending plan are pinned ------------------------------------------------------------

def free(s):
    return s.facade.free_pages if isinstance(s, StepScheduler) else s.free_pages


@pytest.mark.parametrize("retire", ["update", "discard_plan"])
def test_pages_of_a_pending_plan_stay_pinned_after_the_last_request_is_aborted(retire):
    """Aborting the last request of a pending plan frees none of the pages the plan names (a
    kernel may be executing it): nothing allocates them -- the scheduler's pool is its own,
    its mutating calls refuse -- until update() or discard_plan() retires the plan; then the
    pages come back and new requests take them."""
    a, b = pair(16, 4, 8, 2)
    for s in (a, b):
        s.add_request(1, list(range(1, 11)), max_new_tokens=3)
    plan = a.schedule()
    b.schedule()
    named = set((plan.slot_mapping // 4).tolist()) | set(plan.kv_indices.tolist())
    pages = free(a)
    assert pages == free(b) == 16 - len(named)
    for s in (a, b):
        s.abort(1)
        assert not s.has_unfinished()
        assert free(s) == pages               # nothing was handed back yet
    for call in (lambda: a.pool.allocate(), lambda: a.pool.release(min(named)),
                 lambda: a.pool.retain(min(named))):
        with pytest.raises(qualia.BusyError):
            call()
    assert free(a) == pages
    a.add_request(2, [5, 6], max_new_tokens=1)    # queuing allocates nothing: allowed
    a.abort(2)
    if retire == "update":
        ids = sample(plan)
        assert a.update(ids) == [] and b.update(ids) == []
    else:
        a.discard_plan()
        b.discard_plan()
    assert free(a) == free(b) == 16
    for rid in (7, 8):                            # two requests of 8 pages take all 16
        a.add_request(rid, [rid] * 29, max_new_tokens=3)
    taken = a.schedule()
    assert named <= set(taken.kv_indices.tolist()) and len(set(taken.kv_indices.tolist())) == 16


def test_a_pool_that_outlives_its_scheduler_is_handed_back_whole():
    """Every reference in a StepScheduler's pool is the scheduler's (running requests, cached
    pages, a pending plan's): once the scheduler is gone, the pool is unowned with every page
    free, and a pending plan keeps its scheduler alive until it goes too."""
    import gc

    s = make(16, 4, 8, 2)
    s.add_request(1, list(range(1, 11)), max_new_tokens=3)
    s.add_request(2, list(range(1, 9)), max_new_tokens=3)
    s.update(sample(s.schedule()))
    plan = s.schedule()                           # pending, with pages named
    pool = s.pool
    assert pool.free_count < 16 and pool.refcounts().sum() > 0
    del s
    gc.collect()
    with pytest.raises(qualia.BusyError):         # the plan holds its scheduler
        pool.allocate()
    del plan
    gc.collect()
    assert pool.free_count == 16 and pool.refcounts().tolist() == [0] * 16
    assert [pool.allocate() for _ in range(16)] == list(range(16))


def test_an_abort_in_the_pending_plan_returns_its_pages_when_the_plan_is_retired():
    """While other requests keep the step busy, the aborted request's pages are held until the
    plan is applied, and core and twin agree page for page on the way."""
    a, b = pair(32, 4, 8, 4)
    for s in (a, b):
        s.add_request(1, list(range(1, 11)), max_new_tokens=4)
        s.add_request(2, list(range(1, 7)), max_new_tokens=4)
        s.add_request(3, [9, 9, 9, 9, 9], max_new_tokens=4)
    step_both(a, b)
    pa, pb = a.schedule(), b.schedule()
    assert_same_plan(pa, pb)
    pages = free(a)
    for s in (a, b):
        s.abort(2)
        assert free(s) == pages
        s.add_request(2, [4, 4], max_new_tokens=1)   # its id is free again at once
    ids = sample(pa)
    assert a.update(ids) == b.update(ids) == []
    assert free(a) == free(b) > pages
    for _ in range(8):
        if not a.has_unfinished():
            break
        step_both(a, b)
    assert free(a) == free(b)
