"""What a backend hands back is checked before anything of its step is applied (docs/DESIGN.md,
"Beam search at the step level", "The step backend ABI"):

* a beam candidate's log-probability is at most 0: 1e308 (whose sums overflow to +inf, and
  +inf + -inf is NaN) and tiny positive values are refused by ``update()`` and by ``run()`` with
  a Python or a C backend, core and twin alike, with nothing applied;
* a C step backend that returns 0 without writing its sampled ids fails the step: the core sets
  every ``sampled_out`` entry to 2**32-1 (no token id) before each call, so neither the previous
  step's ids nor the buffer's first contents are applied.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers.ctypes_abi import EXECUTE_STEP, CStepBackend
from helpers.groups import GOOD, HB, PROMPT, V, all_pages_back, beam_plan, both, state

import qualia

POSITIVE = [1e308, 1.0, 1e-300, 5e-324]       # float64: the largest to the smallest above 0
POSITIVE_F32 = [3e38, 1.0, 1e-30, 1e-45]      # float32 likewise (1e-45: its smallest denormal)

_KEEP = []


def capsule(execute, flags=2):
    """A C step backend (a "qualia.step_backend.v1" capsule) over a ctypes callback."""
    fn = EXECUTE_STEP(execute)
    iface = CStepBackend(qualia.STEP_ABI_VERSION, ctypes.sizeof(CStepBackend), flags, 0, None,
                         ctypes.cast(fn, ctypes.c_void_p), None)
    name = qualia.STEP_CAPSULE_NAME.encode()
    _KEEP.append((iface, fn, name))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(iface), name, None)


def writer(sampled=lambda step, r: 5, cand=GOOD):
    """execute_step writing sampled(step, r) (None: leaves the row unwritten) and candidates
    cand(row, j) -> (id, log-probability); counts its calls in .steps."""
    calls = []

    def ex(ctx, plan, out, logprobs):
        p = plan.contents
        step = len(calls)
        calls.append(p.num_sampled)
        ids = ctypes.cast(out, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):
            v = sampled(step, r)
            if v is not None:
                ids[r] = v
        if p.num_topk:
            ti = ctypes.cast(p.topk_ids_out, ctypes.POINTER(ctypes.c_uint32))
            tl = ctypes.cast(p.topk_logprobs_out, ctypes.POINTER(ctypes.c_float))
            for r in range(p.num_sampled):
                for j in range(p.num_topk):
                    ti[r * p.num_topk + j], tl[r * p.num_topk + j] = cand(r, j)
        return 0
    cap = capsule(ex)
    return cap, calls


# -- log-probabilities above 0 ------------------------------------------------------------------

@pytest.mark.parametrize("value", POSITIVE)
@pytest.mark.parametrize("where", ["first", "last"])
def test_update_refuses_a_log_probability_above_zero_and_applies_nothing(value, where):
    c, t, plan = beam_plan()
    ids, tids, tlps = HB.execute_step_topk(plan)
    tlps = tlps.astype(np.float64)
    row = 0 if plan.sampled_request_ids[0] == 1 else 1      # the beam row
    bad = tlps.copy()
    if where == "first":
        bad[row, 0] = value         # still best first
    else:
        bad[1 - row, -1] = value    # the plain request's row: every row is checked
    before = state(c, [1]), state(t, [1])
    for s in (c, t):
        with pytest.raises(ValueError, match="above 0"):
            s.update(ids, tids, bad)
    assert (state(c, [1]), state(t, [1])) == before
    for s in (c, t):
        s.update(ids, tids, tlps)
    assert state(c, [1]) == state(t, [1])


def test_zero_and_minus_zero_are_log_probabilities():
    c, t, plan = beam_plan()
    ids, tids, tlps = HB.execute_step_topk(plan)
    tlps = tlps.astype(np.float64)
    tlps[:, 0] = 0.0
    tlps[:, 1] = -0.0
    for s in (c, t):
        s.update(ids, tids, tlps)
    assert state(c, [1]) == state(t, [1])


def test_scores_stay_numbers_when_a_backend_offers_1e308_then_minus_inf():
    """A 1e308 candidate is refused at its step; a group fed -inf candidates afterwards still
    ends with real scores (none NaN)."""
    c, t = both(64, 4, 16, 8)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=2, beam_width=2)
    for s in (c, t):
        plan = s.schedule()
        ids, tids, tlps = HB.execute_step_topk(plan)
        huge = np.full(tlps.shape, 1e308)
        with pytest.raises(ValueError, match="above 0"):
            s.update(ids, tids, huge)
        s.update(ids, tids, tlps)
        plan = s.schedule()
        ids, tids, tlps = HB.execute_step_topk(plan)
        tlps = np.full(tlps.shape, -np.inf)
        (g,) = s.update(ids, tids, tlps)
        assert not any(np.isnan(x) for x in g.scores)


@pytest.mark.parametrize("value", POSITIVE)
def test_run_with_a_python_backend_refuses_a_log_probability_above_zero(value):
    class Backend:
        def execute_step(self, plan):
            ids, tids, tlps = HB.execute_step_topk(plan)
            tlps = tlps.astype(np.float64)
            tlps[:, 0] = value
            return ids, tids, tlps
    c, t = both(64, 4, 16, 8)
    ref = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    for s in (c, t, ref):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
        s.add_request(2, PROMPT[:3], max_new_tokens=2)
    ref.schedule()
    ref.discard_plan()
    for s in (c, t):
        with pytest.raises(ValueError, match="above 0") as info:
            s.run(Backend())
        assert info.value.finished == []
    assert state(c, [1]) == state(ref, [1])
    assert state(c, [1]) == state(t, [1])


@pytest.mark.parametrize("value", POSITIVE_F32)
def test_run_with_a_c_backend_refuses_a_log_probability_above_zero(value):
    c = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    ref = qualia.StepScheduler(64, 4, 16, 8, vocab_size=V)
    for s in (c, ref):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
        s.add_request(2, PROMPT[:3], max_new_tokens=2)
    ref.schedule()
    ref.discard_plan()
    cap, _ = writer(cand=lambda r, j: (GOOD(r, j)[0], value if j == 0 else -1.0 * j))
    with pytest.raises(ValueError, match="above 0") as info:
        c.run(cap)
    assert info.value.finished == []
    assert state(c, [1]) == state(ref, [1])
    good, _ = writer()
    assert len(c.run(good).finished) == 2
    all_pages_back(c)


# -- sampled ids a C backend did not write --------------------------------------------------------

def plain(vocab=V):
    s = qualia.StepScheduler(64, 4, 16, 4, vocab_size=vocab)
    for i in range(3):
        s.add_request(i, PROMPT[i:], max_new_tokens=4)
    return s


@pytest.mark.parametrize("vocab", [V, None])
@pytest.mark.parametrize("unwritten_at", [0, 2])
def test_a_c_backend_that_writes_no_sampled_id_fails_its_step(vocab, unwritten_at):
    """At the first step the buffer never held an id; at a later one it holds the previous
    step's: neither is applied.  The steps before stay applied (their finished requests are on
    the exception) and the failed one is discarded."""
    c, ref = plain(vocab), plain(vocab)
    good, _ = writer()
    if unwritten_at:
        ref.run(good, max_steps=unwritten_at)
    ref.schedule()
    ref.discard_plan()
    lazy, calls = writer(sampled=lambda step, r: None if step == unwritten_at else 5)
    with pytest.raises(ValueError, match="without writing sampled row 0"):
        c.run(lazy)
    assert len(calls) == unwritten_at + 1
    assert state(c) == state(ref)
    assert [f.output_tokens.tolist() for f in c.run(good).finished] == \
        [f.output_tokens.tolist() for f in ref.run(good).finished]
    all_pages_back(c)


@pytest.mark.parametrize("row", [0, 1, 2])
def test_one_unwritten_row_fails_the_step(row):
    c, ref = plain(), plain()
    ref.schedule()
    ref.discard_plan()
    lazy, _ = writer(sampled=lambda step, r: None if r == row else 5)
    with pytest.raises(ValueError, match=f"without writing sampled row {row}"):
        c.run(lazy)
    assert state(c) == state(ref)


def test_a_sampled_id_of_2_to_the_32_minus_1_is_no_token_id():
    # without a vocab_size every other uint32 is an id; this one marks a row not written
    c, ref = plain(None), plain(None)
    ref.schedule()
    ref.discard_plan()
    cap, _ = writer(sampled=lambda step, r: 2**32 - 1)
    with pytest.raises(ValueError, match="without writing sampled row 0"):
        c.run(cap)
    assert state(c) == state(ref)
    top, _ = writer(sampled=lambda step, r: 2**32 - 2)
    assert len(c.run(top).finished) == 3


def test_a_sampled_id_past_the_vocabulary_still_fails_the_step():
    c, ref = plain(), plain()
    ref.schedule()
    ref.discard_plan()
    cap, _ = writer(sampled=lambda step, r: V)
    with pytest.raises(ValueError, match="outside"):
        c.run(cap)
    assert state(c) == state(ref)


def test_call_step_backend_refuses_unwritten_rows():
    from qualia._core import _call_step_backend
    s = plain()
    plan = s.schedule()
    out = np.zeros(len(plan.logits_indices), dtype=np.uint32)      # ids a caller kept
    lazy, _ = writer(sampled=lambda step, r: None)
    with pytest.raises(ValueError, match="without writing sampled row 0"):
        _call_step_backend(lazy, plan, sampled_out=out)
    good, _ = writer()
    assert _call_step_backend(good, plan, sampled_out=out).tolist() == [5] * len(out)
