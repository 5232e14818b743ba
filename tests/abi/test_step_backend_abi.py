"""The step backend ABI (csrc/qualia.h, "qualia.step_backend.v1"): the compiled structs match the
spec table, the core resolves and checks step capsules as it does round capsules, and the hash
backend's execute_step follows the decode round's rule, through its capsule and as a Python
method.  Plans are built here by hand (``make_plan``) in the StepPlan conventions, so these tests
do not depend on ``Scheduler.schedule``."""

from __future__ import annotations

import ctypes
import gc
import types

import numpy as np
import pytest
from helpers.ctypes_abi import (
    EXECUTE_STEP,
    STEP_PLAN_COUNTS,
    STEP_PLAN_POINTERS,
    CStepBackend,
    CStepPlan,
)
from helpers.step_checks import example_rule, example_topk_rule
from hypothesis import given, settings
from hypothesis import strategies as st

import qualia
from qualia import _core

# Offsets of the step ABI on LP64 (the table of docs/DESIGN.md, "The step backend ABI").
PLAN_COUNTS = STEP_PLAN_COUNTS
PLAN_POINTERS = STEP_PLAN_POINTERS
PLAN_TAIL = ["num_topk", "num_forks", "topk_ids_out", "topk_logprobs_out", "fork_child_ids",
             "fork_parent_ids"]
STEP_PLAN_OFFSETS = {**{name: 4 * i for i, name in enumerate(PLAN_COUNTS)},
                     **{name: 64 + 8 * i for i, name in enumerate(PLAN_POINTERS)},
                     "num_topk": 208, "num_forks": 212, "topk_ids_out": 216,
                     "topk_logprobs_out": 224, "fork_child_ids": 232, "fork_parent_ids": 240}
STEP_BACKEND_OFFSETS = {"abi_version": 0, "struct_size": 4, "flags": 8, "_reserved": 12,
                        "ctx": 16, "execute_step": 24, "copy_pages": 32}


# -- plans built by hand ---------------------------------------------------------------------


def make_plan(reqs, page_tokens=4, rows=8, cols=8, copies=(), changed_rows=None):
    """A StepPlan-shaped namespace.  Each request: dict(rid, tokens, computed, chunk, pages, row);
    it computes tokens[computed:computed+chunk] and is sampled when that reaches len(tokens)."""
    qsl, seq_lens, input_ids, positions, slots, logits, sampled = [0], [], [], [], [], [], []
    kv_indptr, kv_indices, last = [0], [], []
    table = np.full((rows, cols), -1, np.int32)
    for r in reqs:
        start, end = r["computed"], r["computed"] + r["chunk"]
        for pos in range(start, end):
            input_ids.append(r["tokens"][pos])
            positions.append(pos)
            slots.append(r["pages"][pos // page_tokens] * page_tokens + pos % page_tokens)
        qsl.append(len(input_ids))
        seq_lens.append(end)
        if end == len(r["tokens"]):
            logits.append(len(input_ids) - 1)
            sampled.append(r["rid"])
        used = r["pages"][: -(-end // page_tokens)]
        kv_indices.extend(used)
        kv_indptr.append(len(kv_indices))
        last.append(end - (len(used) - 1) * page_tokens)
        table[r["row"], : len(r["pages"])] = r["pages"]
    rows_used = [r["row"] for r in reqs]
    copies_arr = np.zeros(len(copies), qualia.COPY_OP)
    for i, (src, dst) in enumerate(copies):
        copies_arr[i] = (src, dst)
    n_decode = sum(1 for r in reqs if r["chunk"] == 1 and r["computed"] + 1 == len(r["tokens"]))
    return types.SimpleNamespace(
        page_tokens=page_tokens,
        request_ids=np.array([r["rid"] for r in reqs], np.uint64),
        query_start_loc=np.array(qsl, np.int32),
        seq_lens=np.array(seq_lens, np.int32),
        input_ids=np.array(input_ids, np.uint32),
        positions=np.array(positions, np.int32),
        slot_mapping=np.array(slots, np.int64),
        logits_indices=np.array(logits, np.int32),
        sampled_request_ids=np.array(sampled, np.uint64),
        block_table=table,
        block_table_rows=np.array(rows_used, np.int32),
        changed_rows=np.array(sorted(rows_used) if changed_rows is None else changed_rows,
                              np.int32),
        kv_indptr=np.array(kv_indptr, np.int32),
        kv_indices=np.array(kv_indices, np.int32),
        kv_last_page_len=np.array(last, np.int32),
        copies=copies_arr,
        new_request_ids=np.zeros(0, np.uint64),
        preempted_request_ids=np.zeros(0, np.uint64),
        finished_request_ids=np.zeros(0, np.uint64),
        num_prefill_tokens=len(input_ids) - n_decode,
        num_decode_tokens=n_decode,
    )


def mixed_plan():
    """Two decodes, one prompt's middle chunk (not sampled), one prompt's last chunk."""
    return make_plan([
        dict(rid=11, tokens=list(range(100, 110)), computed=9, chunk=1, pages=[3, 5, 7], row=0),
        dict(rid=2**64 - 1, tokens=[5, 6, 7, 8, 9], computed=4, chunk=1, pages=[1, 2], row=3),
        dict(rid=0, tokens=list(range(30)), computed=4, chunk=8, pages=[9, 10, 11, 12, 13, 14, 15,
                                                                         16], row=1),
        dict(rid=42, tokens=[7] * 6, computed=2, chunk=4, pages=[20, 21], row=2),
    ])


def hash_rule(plan, vocab):
    out = []
    for rid, t in zip(plan.sampled_request_ids.tolist(), plan.logits_indices.tolist()):
        out.append(qualia.hash_next_token(rid, int(plan.positions[t]), int(plan.input_ids[t]),
                                          vocab))
    return np.array(out, np.uint32)


# -- layout ------------------------------------------------------------------------------------


def test_step_plan_struct_matches_spec():
    size, align, fields = _core._layout()["step_plan"]
    # 208 bytes, then the beam-row and fork fields appended in the same ABI version
    assert size == _core.STEP_PLAN_STRUCT_SIZE == 64 + 8 * len(PLAN_POINTERS) + 40 == 248
    assert align == 8
    assert [f[0] for f in fields] == PLAN_COUNTS + PLAN_POINTERS + PLAN_TAIL
    assert {name: off for name, _fmt, off in fields} == STEP_PLAN_OFFSETS


def test_step_backend_struct_matches_spec():
    size, align, fields = _core._layout()["step_backend"]
    assert size == _core.STEP_BACKEND_STRUCT_SIZE == 40
    assert align == 8
    assert {name: off for name, _fmt, off in fields} == STEP_BACKEND_OFFSETS


def test_step_constants():
    assert qualia.STEP_CAPSULE_NAME == _core.STEP_CAPSULE_NAME == "qualia.step_backend.v1"
    assert qualia.STEP_ABI_VERSION == _core.STEP_ABI_VERSION == 1
    assert _core.STEP_WRITES_LOGPROBS == 1
    assert _core.STEP_WRITES_TOPK == 2
    assert _core.STEP_NO_CSR == 4


def test_ctypes_mirror_matches_the_compiled_structs():
    assert ctypes.sizeof(CStepPlan) == _core.STEP_PLAN_STRUCT_SIZE
    assert {n: getattr(CStepPlan, n).offset for n in PLAN_COUNTS + PLAN_POINTERS + PLAN_TAIL} == \
        STEP_PLAN_OFFSETS
    assert ctypes.sizeof(CStepBackend) == _core.STEP_BACKEND_STRUCT_SIZE


def test_hash_step_reads_a_hand_filled_struct():
    """Called through its capsule's function pointer with a qualia_step_plan filled field by
    field (ctypes, no lowering by the core), the hash backend samples by the rule."""
    plan = mixed_plan()
    hb, iface = _hash_iface()
    assert (iface.abi_version, iface.flags) == \
        (1, _core.STEP_WRITES_LOGPROBS | _core.STEP_WRITES_TOPK | _core.STEP_NO_CSR)
    c = CStepPlan()
    c.struct_size = ctypes.sizeof(CStepPlan)
    c.page_tokens = plan.page_tokens
    c.num_requests = len(plan.request_ids)
    c.num_tokens = len(plan.input_ids)
    c.num_sampled = len(plan.logits_indices)
    for name in PLAN_POINTERS:
        setattr(c, name, getattr(plan, name).ctypes.data)
    sampled = np.zeros(3, np.uint32)
    lps = np.zeros(3, np.float32)
    fn = EXECUTE_STEP(iface.execute_step)
    assert fn(iface.ctx, ctypes.byref(c), sampled.ctypes.data, lps.ctypes.data) == 0
    assert np.array_equal(sampled, hash_rule(plan, 32000))
    assert lps.tolist() == [qualia.hash_logprob(int(rid), int(plan.positions[t]),
                                                int(plan.input_ids[t]))
                            for rid, t in zip(plan.sampled_request_ids, plan.logits_indices)]
    assert fn(iface.ctx, ctypes.byref(c), sampled.ctypes.data, None) == 0  # logprobs not asked
    c.num_tokens = 5  # logits_indices now point past T: the C step refuses (status -22)
    assert fn(iface.ctx, ctypes.byref(c), sampled.ctypes.data, None) == -22
    assert hb.step_calls == 3


def test_round_abi_is_unchanged():
    """The step ABI is an addition: the v1 round structs and constants stay as they were."""
    assert _core.BACKEND_STRUCT_SIZE == 32
    assert qualia.BACKEND_CAPSULE_NAME == "qualia.backend.v1"
    assert qualia.BACKEND_ABI_VERSION == 1


def test_c_consumer_sees_the_same_step_layout(example_backend):
    c_layout = example_backend.layout()
    for name, offsets in (("step_plan", STEP_PLAN_OFFSETS),
                          ("step_backend", STEP_BACKEND_OFFSETS)):
        size, align, fields = c_layout[name]
        csize, calign, _ = _core._layout()[name]
        assert (size, align) == (csize, calign)
        assert fields == offsets


def test_cython_consumer_sees_the_same_step_layout(cython_backend):
    sizes = cython_backend.sizes()
    assert sizes["step_plan"] == _core.STEP_PLAN_STRUCT_SIZE
    assert sizes["step_backend"] == _core.STEP_BACKEND_STRUCT_SIZE
    assert cython_backend.step_plan_offsets() == STEP_PLAN_OFFSETS


# -- the hash backend's step -----------------------------------------------------------------


def test_hash_execute_step_follows_the_round_rule():
    plan = mixed_plan()
    hb = qualia.HashBackend(vocab=1000)
    got = hb.execute_step(plan)
    assert got.dtype == np.uint32 and len(got) == 3  # the middle chunk is not sampled
    assert np.array_equal(got, hash_rule(plan, 1000))
    assert (hb.step_calls, hb.sampled) == (1, 3)


def test_hash_execute_step_agrees_with_a_decode_round():
    """For the same (request id, input token, position), a step samples what a round outputs."""
    plan = mixed_plan()
    hb = qualia.HashBackend(vocab=50_000)
    sampled = hb.execute_step(plan)
    items = np.zeros(len(sampled), qualia.RAGGED_BATCH_ITEM)
    for r, t in enumerate(plan.logits_indices.tolist()):
        items[r]["request_id"] = plan.sampled_request_ids[r]
        items[r]["slot"] = r
        items[r]["token_id"] = plan.input_ids[t]
        items[r]["position"] = plan.positions[t]
    outputs = np.zeros(len(items), qualia.RAGGED_BATCH_OUTPUT)
    hb.execute_ragged(items, np.zeros(0, np.uint32), outputs)
    assert np.array_equal(outputs["next_token_id"], sampled)


def test_hash_execute_step_through_its_capsule_equals_the_method():
    plan = mixed_plan()
    hb = qualia.HashBackend(vocab=977)
    via_capsule, lps = _core._call_step_backend(hb, plan, logprobs=True)
    assert np.array_equal(via_capsule, hb.execute_step(plan))
    assert hb.step_calls == 2


def test_hash_logprobs_are_the_documented_rule():
    plan = mixed_plan()
    hb = qualia.HashBackend(vocab=977)
    lps = np.full(3, 1.0, np.float32)
    hb.execute_step(plan, logprobs_out=lps)
    want = [qualia.hash_logprob(int(rid), int(plan.positions[t]), int(plan.input_ids[t]))
            for rid, t in zip(plan.sampled_request_ids, plan.logits_indices)]
    assert lps.tolist() == want
    assert all(-16.0 < v <= 0.0 for v in want)
    _sampled, via_capsule = _core._call_step_backend(hb, plan, logprobs=True)
    assert via_capsule.tolist() == want


def test_hash_logprob_formula():
    rid, pos, tok = 7, 3, 11
    mask = 2**64 - 1
    x = (rid * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + tok) & mask
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & mask
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    assert qualia.hash_logprob(rid, pos, tok) == -(x & 0xFFFF) / 4096


def test_twin_hash_backend_steps_alike():
    from qualia.twin import PyHashBackend

    plan = mixed_plan()
    core, twin = qualia.HashBackend(vocab=991), PyHashBackend(vocab=991)
    lp_core, lp_twin = np.zeros(3, np.float32), np.zeros(3, np.float32)
    assert np.array_equal(core.execute_step(plan, logprobs_out=lp_core),
                          twin.execute_step(plan, logprobs_out=lp_twin))
    assert lp_core.tolist() == lp_twin.tolist()
    assert (twin.step_calls, twin.sampled) == (core.step_calls, core.sampled) == (1, 3)
    with pytest.raises(qualia.RaggedBackendError.Failed):
        PyHashBackend(fault="error", code=5).execute_step(plan)


def test_hash_execute_step_into_caller_arrays():
    plan = mixed_plan()
    hb = qualia.HashBackend(vocab=1000)
    out = np.zeros(5, np.uint32)
    assert hb.execute_step(plan, sampled_out=out) is out
    assert np.array_equal(out[:3], hash_rule(plan, 1000)) and out[3:].tolist() == [0, 0]


def test_hash_execute_step_fault_error():
    hb = qualia.HashBackend(vocab=10, fault="error", code=-7)
    with pytest.raises(qualia.RaggedBackendError.Failed) as err:
        hb.execute_step(mixed_plan())
    assert err.value.code == -7
    with pytest.raises(qualia.RaggedBackendError.Failed):
        _core._call_step_backend(hb, mixed_plan())


def test_hash_execute_step_empty_plan():
    plan = make_plan([])
    assert len(qualia.HashBackend().execute_step(plan)) == 0


def test_step_capsule_outlives_the_backend_object():
    hb = qualia.HashBackend(vocab=1000)
    cap = hb.__qualia_step_backend__
    round_cap = hb.__qualia_backend__
    del hb, round_cap
    gc.collect()
    assert np.array_equal(_core._call_step_backend(cap, mixed_plan()),
                          hash_rule(mixed_plan(), 1000))


def test_copy_pages_runs_before_execute_step():
    plan = make_plan([dict(rid=1, tokens=[1, 2, 3], computed=2, chunk=1, pages=[4], row=0)],
                     copies=[(4, 5), (6, 7)])
    hb = qualia.HashBackend()
    _core._call_step_backend(hb, plan)
    assert (hb.copy_calls, hb.pages_copied, hb.step_calls) == (1, 2, 1)
    _core._call_step_backend(hb, make_plan([dict(rid=1, tokens=[1, 2, 3], computed=2, chunk=1,
                                                 pages=[4], row=0)]))
    assert (hb.copy_calls, hb.step_calls) == (1, 2)  # no copies, no copy_pages call


# -- bad plans: a clear error, and no output written ------------------------------------------


def _bad(mutate):
    plan = mixed_plan()
    mutate(plan)
    return plan


BAD_PLANS = {
    "logits index past T": (lambda p: p.logits_indices.__setitem__(0, len(p.input_ids)),
                            ValueError),
    "negative logits index": (lambda p: p.logits_indices.__setitem__(1, -1), ValueError),
    "short positions": (lambda p: setattr(p, "positions", p.positions[:-1]), ValueError),
    "sampled ids length": (lambda p: setattr(p, "sampled_request_ids",
                                             p.sampled_request_ids[:1]), ValueError),
    "query_start_loc end": (lambda p: p.query_start_loc.__setitem__(-1, 3), ValueError),
    "kv_indptr decreasing": (lambda p: p.kv_indptr.__setitem__(1, 100), ValueError),
    "block_table_rows out of range": (lambda p: p.block_table_rows.__setitem__(0, 8),
                                      ValueError),
    "changed row out of range": (lambda p: setattr(p, "changed_rows",
                                                   np.array([9], np.int32)), ValueError),
    "input_ids dtype": (lambda p: setattr(p, "input_ids", p.input_ids.astype(np.int64)),
                        TypeError),
    "positions as a list": (lambda p: setattr(p, "positions", p.positions.tolist()), TypeError),
    "block_table 1-D": (lambda p: setattr(p, "block_table", p.block_table.ravel()), ValueError),
    "block_table dtype": (lambda p: setattr(p, "block_table", p.block_table.astype(np.int64)),
                          TypeError),
    "block_table columns strided": (lambda p: setattr(p, "block_table", p.block_table[:, ::2]),
                                    ValueError),
    "missing input_ids": (lambda p: delattr(p, "input_ids"), TypeError),
    "page_tokens negative": (lambda p: setattr(p, "page_tokens", -1), OverflowError),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_is_refused_before_the_backend_runs(case, example_backend):
    mutate, exc = BAD_PLANS[case]
    plan = _bad(mutate)
    hb = qualia.HashBackend()
    out = np.full(3, 123, np.uint32)
    with pytest.raises(exc):
        hb.execute_step(plan, sampled_out=out)
    with pytest.raises(exc):
        _core._call_step_backend(hb, plan, sampled_out=out)
    cap = example_backend.new_step(1000)
    with pytest.raises(exc):
        _core._call_step_backend(cap, plan, sampled_out=out)
    assert hb.step_calls == 0 and example_backend.step_stats(cap)[0] == 0
    assert out.tolist() == [123, 123, 123]


@pytest.mark.parametrize("out, exc", [
    (np.zeros(2, np.uint32), ValueError),           # shorter than m
    (np.zeros(3, np.int32), TypeError),             # wrong dtype
    (np.zeros(3, np.uint32)[::-1], ValueError),     # not contiguous
    ([0, 0, 0], TypeError),                         # not a buffer
])
def test_bad_sampled_out(out, exc):
    hb = qualia.HashBackend()
    with pytest.raises(exc):
        hb.execute_step(mixed_plan(), sampled_out=out)
    assert hb.step_calls == 0


def test_read_only_sampled_out_is_refused():
    out = np.zeros(3, np.uint32)
    out.flags.writeable = False
    with pytest.raises(ValueError):
        qualia.HashBackend().execute_step(mixed_plan(), sampled_out=out)


def test_a_wider_block_table_view_is_lowered_with_its_row_stride(example_backend):
    plan = mixed_plan()
    wide = np.full((8, 12), -5, np.int32)
    wide[:, :8] = plan.block_table
    plan.block_table = wide[:, :8]  # row stride 12 entries, 8 columns
    cap = example_backend.new_step(1000)
    assert np.array_equal(_core._call_step_backend(cap, plan), example_rule(plan, 1000))


def test_a_block_table_in_any_int32_spelling_is_lowered_alike(example_backend):
    # numpy's own spelling, a ctypes array's ("<i") and numpy's explicit byte orders: one table
    plan = mixed_plan()
    want = _core._call_step_backend(example_backend.new_step(1000), plan)
    rows, cols = plan.block_table.shape
    ct = (ctypes.c_int32 * cols * rows)()
    np.frombuffer(ct, np.int32).reshape(rows, cols)[:] = plan.block_table
    assert memoryview(ct).format != memoryview(plan.block_table).format
    table = plan.block_table
    for spelled in (ct, table.astype("<i4"), table.astype("=i4")):
        plan.block_table = spelled
        got = _core._call_step_backend(example_backend.new_step(1000), plan)
        assert np.array_equal(got, want)
        assert np.array_equal(qualia.HashBackend().execute_step(plan),
                              qualia.HashBackend().execute_step(mixed_plan()))


# -- capsule resolution and validation -------------------------------------------------------

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _hash_iface():
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    hb = qualia.HashBackend()
    cap = hb.__qualia_step_backend__
    return hb, CStepBackend.from_address(get(cap, qualia.STEP_CAPSULE_NAME.encode()))


_KEEP = []


def _capsule(name=b"qualia.step_backend.v1", **changes):
    hb, real = _hash_iface()
    iface = CStepBackend(real.abi_version, real.struct_size, real.flags, 0, real.ctx,
                       real.execute_step, real.copy_pages)
    for k, v in changes.items():
        setattr(iface, k, v)
    _KEEP.append((hb, iface, name))  # the capsule holds raw pointers into these
    return _new_capsule(ctypes.addressof(iface), name, None)


@pytest.mark.parametrize("changes, message", [
    (dict(name=b"qualia.backend.v1"), "named"),
    (dict(name=b"qualia.step_backend.v2"), "named"),
    (dict(abi_version=2), "ABI version"),
    (dict(struct_size=32), "struct_size"),
    (dict(execute_step=None), "NULL"),
])
def test_bad_step_capsules_raise_backend_abi_error(changes, message):
    cap = _capsule(**changes)
    for given_as in (cap, types.SimpleNamespace(__qualia_step_backend__=cap),
                     type("B", (), {"__qualia_step_backend__": lambda self: cap})()):
        with pytest.raises(qualia.BackendAbiError, match=message):
            _core._call_step_backend(given_as, mixed_plan())


def test_a_larger_struct_size_is_accepted():
    """A backend built against a later header (a longer struct) still resolves."""
    cap = _capsule(struct_size=64)
    assert np.array_equal(_core._call_step_backend(cap, mixed_plan()),
                          hash_rule(mixed_plan(), 32000))


def test_round_capsule_is_not_a_step_capsule():
    hb = qualia.HashBackend()
    with pytest.raises(qualia.BackendAbiError, match="named"):
        _core._call_step_backend(hb.__qualia_backend__, mixed_plan())
    with pytest.raises(qualia.BackendAbiError):
        _core._call_step_backend(types.SimpleNamespace(__qualia_step_backend__=42), mixed_plan())
    with pytest.raises(TypeError):
        _core._call_step_backend(object(), mixed_plan())


# -- the separately compiled example (examples/c_backend) ------------------------------------


@pytest.mark.parametrize("handover", ["capsule", "attribute", "method"])
def test_example_step_backend_end_to_end(example_backend, handover):
    cap = example_backend.new_step(997)
    given_as = {"capsule": cap,
                "attribute": types.SimpleNamespace(__qualia_step_backend__=cap),
                "method": type("B", (), {"__qualia_step_backend__": lambda self: cap})()}[handover]
    plan = make_plan([
        dict(rid=11, tokens=list(range(100, 110)), computed=9, chunk=1, pages=[3, 5, 7], row=0),
        dict(rid=0, tokens=list(range(30)), computed=4, chunk=8, pages=[9, 10, 11, 12], row=1),
        dict(rid=42, tokens=[7] * 6, computed=2, chunk=4, pages=[20, 21], row=2),
    ], copies=[(3, 4)])
    sampled = _core._call_step_backend(given_as, plan)
    assert np.array_equal(sampled, example_rule(plan, 997))
    assert example_backend.step_stats(cap) == (1, 2, 1)


def test_cython_step_backend_end_to_end(cython_backend):
    backend = cython_backend.StepBackend(991)
    plan = mixed_plan()
    lps = np.zeros(3, np.float32)
    sampled, got = _core._call_step_backend(backend, plan, logprobs_out=lps)
    assert got is lps and np.array_equal(sampled, example_rule(plan, 991))
    assert np.isnan(lps).all()  # it does not declare QUALIA_STEP_WRITES_LOGPROBS
    assert backend.stats() == (1, 3)


def test_example_step_backend_logprobs(example_backend):
    plan = mixed_plan()
    with_lp = example_backend.new_step(1000, True)
    sampled, lps = _core._call_step_backend(with_lp, plan, logprobs=True)
    assert lps.tolist() == [-(float(np.float32(s)) / 1000) for s in sampled.tolist()] or \
        np.allclose(lps, -sampled.astype(np.float32) / np.float32(1000))
    without = example_backend.new_step(1000)  # no QUALIA_STEP_WRITES_LOGPROBS: NaN
    sampled2, lps2 = _core._call_step_backend(without, plan, logprobs=True)
    assert np.array_equal(sampled, sampled2) and np.isnan(lps2).all()


def _iface_of(cap):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return CStepBackend.from_address(get(cap, qualia.STEP_CAPSULE_NAME.encode()))


def _hand_filled(plan):
    c = CStepPlan()
    c.struct_size = ctypes.sizeof(CStepPlan)
    for name in STEP_PLAN_COUNTS[1:]:
        if hasattr(plan, name):
            setattr(c, name, int(getattr(plan, name)))
    c.num_requests = len(plan.request_ids)
    c.num_tokens = len(plan.input_ids)
    c.num_sampled = len(plan.logits_indices)
    c.num_kv_indices = len(plan.kv_indices)
    c.block_table_num_rows, c.block_table_num_cols = plan.block_table.shape
    c.block_table_row_stride = plan.block_table.shape[1]
    for name in PLAN_POINTERS:
        setattr(c, name, getattr(plan, name).ctypes.data)
    return c


def _example_step_capsules(example_backend, cython_backend, vocab, topk=True):
    cy = cython_backend.StepBackend(vocab, topk=topk)
    return {"c": (example_backend.new_step(vocab, topk=topk), None),
            "cython": (cy.__qualia_step_backend__, cy)}


@pytest.mark.parametrize("kind", ["c", "cython"])
def test_example_step_backends_write_candidates_only_inside_struct_size(
        example_backend, cython_backend, kind):
    """The examples declare QUALIA_STEP_WRITES_TOPK and, called with a hand-filled plan, write
    num_topk candidates per sampled row by their rule; a plan whose struct_size ends before the
    beam-row fields (an older scheduler's) has no candidates, whatever lies past it, and
    topk=False leaves the flag out and writes none."""
    plan = mixed_plan()
    cap, _keep = _example_step_capsules(example_backend, cython_backend, 50)[kind]
    iface = _iface_of(cap)
    assert iface.flags & _core.STEP_WRITES_TOPK
    fn = EXECUTE_STEP(iface.execute_step)
    c = _hand_filled(plan)
    sampled = np.zeros(3, np.uint32)
    tids, tlps = np.zeros((3, 4), np.uint32), np.zeros((3, 4), np.float32)
    c.num_topk, c.topk_ids_out, c.topk_logprobs_out = 4, tids.ctypes.data, tlps.ctypes.data
    assert fn(iface.ctx, ctypes.byref(c), sampled.ctypes.data, None) == 0
    want = example_topk_rule(plan, 50, 4)
    assert np.array_equal(sampled, want[0]) and np.array_equal(tids, want[1])
    assert tlps.tolist() == want[2].tolist() and all((np.diff(tlps, axis=1) < 0).ravel())
    # an older scheduler: struct_size ends at finished_request_ids; num_topk past it is garbage
    tids[:], tlps[:] = 7, 7.0
    c.struct_size = CStepPlan.num_topk.offset
    c.num_topk, c.topk_ids_out, c.topk_logprobs_out = 0xFFFFFFFF, None, None
    assert fn(iface.ctx, ctypes.byref(c), sampled.ctypes.data, None) == 0
    assert np.array_equal(sampled, want[0])
    # more candidates than ids: the backend's own status 23; missing buffers: 22
    c.struct_size = ctypes.sizeof(CStepPlan)
    c.num_topk = 51
    c.topk_ids_out, c.topk_logprobs_out = tids.ctypes.data, tlps.ctypes.data
    assert fn(iface.ctx, ctypes.byref(c), sampled.ctypes.data, None) == 23
    c.num_topk, c.topk_ids_out = 2, None
    assert fn(iface.ctx, ctypes.byref(c), sampled.ctypes.data, None) == 22
    assert (tids == 7).all() and (tlps == 7.0).all()
    # without the flag: nothing written even when asked
    cap2, _keep2 = _example_step_capsules(example_backend, cython_backend, 50, topk=False)[kind]
    iface2 = _iface_of(cap2)
    assert not iface2.flags & _core.STEP_WRITES_TOPK
    c.num_topk, c.topk_ids_out = 2, tids.ctypes.data
    assert EXECUTE_STEP(iface2.execute_step)(iface2.ctx, ctypes.byref(c), sampled.ctypes.data,
                                             None) == 0
    assert (tids == 7).all() and np.array_equal(sampled, want[0])


def test_example_step_backend_returns_its_own_status(example_backend):
    # a plan the lowering would refuse, handed to the C function directly: the example checks
    # it too, and its status comes back as RaggedBackendError.Failed through a Python loop
    plan = mixed_plan()
    plan.slot_mapping[0] += 1  # inconsistent with the page of its position
    cap = example_backend.new_step(1000)
    iface = _iface_of(cap)
    sampled = np.zeros(3, np.uint32)
    assert EXECUTE_STEP(iface.execute_step)(iface.ctx, ctypes.byref(_hand_filled(plan)),
                                            sampled.ctypes.data, None) == 19


def _layout_breaks():
    # (what is changed in mixed_plan(), the message it is refused with)
    def count(plan):
        plan.num_prefill_tokens += 1

    def page_tokens(plan):
        plan.page_tokens = 0

    def position(plan):
        plan.positions[0] += 1

    def slot(plan):
        plan.slot_mapping[0] += 1

    def last_page(plan):
        plan.kv_last_page_len[0] = -3

    def kv_page(plan):
        plan.kv_indices[0] += 1

    def seq_len(plan):
        plan.seq_lens[2] = 3       # its chunk is 8 tokens

    def no_page(plan):
        plan.block_table[plan.block_table_rows[0], 1] = -1

    def missing(plan):
        del plan.num_decode_tokens

    return [(count, "num_prefill_tokens"), (page_tokens, "page_tokens"),
            (position, "positions"), (slot, "slot_mapping"), (last_page, "kv_last_page_len"),
            (kv_page, "kv_indices"), (seq_len, "seq_lens"), (no_page, "no page"),
            (missing, "num_decode_tokens")]


@pytest.mark.parametrize("brk,message", _layout_breaks(), ids=lambda v: getattr(v, "__name__", ""))
def test_a_lowered_plan_is_held_to_the_layout_the_abi_states(brk, message):
    # counts that add up to the tokens, positions that end each context, slots of the rows'
    # pages, the CSR form of the pages covering seq_lens: refused before the backend runs
    backend = qualia.HashBackend(1000)
    plan = mixed_plan()
    honest = backend.execute_step(plan).tolist()
    brk(plan)
    with pytest.raises((ValueError, TypeError), match=message):
        backend.execute_step(plan)
    assert backend.execute_step(mixed_plan()).tolist() == honest


# -- property: any well-formed plan ----------------------------------------------------------


@st.composite
def plans(draw):
    page_tokens = draw(st.integers(1, 8))
    n = draw(st.integers(0, 6))
    rows = draw(st.integers(max(n, 1), 8))
    row_ids = draw(st.permutations(range(rows)))[:n]
    reqs, next_page = [], 0
    for i in range(n):
        length = draw(st.integers(1, 40))
        computed = draw(st.integers(0, length - 1))
        chunk = draw(st.integers(1, length - computed))
        pages = list(range(next_page, next_page + -(-length // page_tokens)))
        next_page += len(pages)
        tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=length, max_size=length))
        reqs.append(dict(rid=draw(st.integers(0, 2**64 - 1)), tokens=tokens, computed=computed,
                         chunk=chunk, pages=pages, row=row_ids[i]))
    cols = max([len(r["pages"]) for r in reqs] + [1])
    return make_plan(reqs, page_tokens=page_tokens, rows=rows, cols=cols)


@settings(max_examples=600, deadline=None)
@given(plan=plans(), vocab=st.integers(1, 2**32 - 1))
def test_step_backends_match_their_rules_on_any_plan(example_backend, plan, vocab):
    hb = qualia.HashBackend(vocab=vocab)
    want = hash_rule(plan, vocab)
    assert np.array_equal(hb.execute_step(plan), want)
    assert np.array_equal(_core._call_step_backend(hb, plan), want)
    # the separately compiled example checks the plan's consistency (status 18/19 otherwise)
    cap = example_backend.new_step(vocab)
    assert np.array_equal(_core._call_step_backend(cap, plan), example_rule(plan, vocab))


# -- plans of the pure-Python twin of the engine step -----------------------------------------


def _twin(**kw):
    from qualia.twin import StepScheduler

    args = dict(num_pages=40, page_tokens=4, logical_pages=16, max_num_seqs=6,
                max_num_batched_tokens=24, max_prefill_chunk=10)
    args.update(kw)
    return StepScheduler(**args)


def _add_requests(s, seed=3, n=10):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 1000, 12).tolist()
    prompts = {}
    for rid in range(n):
        own = rng.integers(0, 1000, int(rng.integers(1, 20))).tolist()
        prompt = (shared if rid % 2 else []) + own
        prompts[rid] = prompt
        s.add_request(rid, np.array(prompt, np.uint32), max_new_tokens=int(rng.integers(1, 12)),
                      priority=int(rng.integers(0, 3)))
    return prompts


def test_twin_step_run_with_the_c_hash_backend_follows_the_decode_rule():
    """A run of steps samples what the engine's prefill rule and decode rounds give: the first
    output is the hash of the prompt's last token at its position, each later one the hash of the
    previous output at the next position."""
    s = _twin()
    prompts = _add_requests(s)
    result = s.run(qualia.HashBackend(vocab=1000))
    assert len(result.finished) == len(prompts)
    for fin in result.finished:
        seq = list(prompts[fin.request_id])
        for out in fin.output_tokens.tolist():
            assert out == qualia.hash_next_token(fin.request_id, len(seq) - 1, seq[-1], 1000)
            seq.append(out)


def test_twin_plans_pass_the_compiled_example_and_match_the_python_twin(example_backend):
    """Every plan of a run with chunking, prefix hits and preemptions (a small pool) is lowered,
    accepted by the separately compiled example's consistency checks, and sampled alike by the C
    hash backend (capsule and method) and its Python twin."""
    from qualia.twin import PyHashBackend

    s = _twin(num_pages=14)
    _add_requests(s, seed=5, n=12)
    hb, twin = qualia.HashBackend(vocab=777), PyHashBackend(vocab=777)
    cap = example_backend.new_step(777)
    preempted = 0
    while s.has_unfinished():
        plan = s.schedule()
        preempted += len(plan.preempted_request_ids)
        want = twin.execute_step(plan)
        assert np.array_equal(hb.execute_step(plan), want)
        assert np.array_equal(_core._call_step_backend(hb, plan), want)
        assert np.array_equal(_core._call_step_backend(cap, plan), example_rule(plan, 777))
        s.update(want)
    assert preempted > 0


class PyExampleStep:
    """examples/c_backend's step model as a Python step backend."""

    def __init__(self, vocab):
        self.vocab = vocab

    def execute_step(self, plan):
        return example_rule(plan, self.vocab)


@pytest.mark.skipif(not hasattr(qualia, "StepScheduler"), reason="the engine step is not built")
@pytest.mark.parametrize("kind", ["hash", "example"])
def test_core_run_with_c_step_backends_matches_the_twin(example_backend, kind):
    """StepScheduler.run drives a separately compiled step backend (the example checks every plan's
    block-table rows and slot mapping against its CSR pages) or the C hash backend without the
    GIL, and finishes every request with the outputs the twin gets from the same rule."""
    from qualia.twin import PyHashBackend

    kw = dict(num_pages=14, page_tokens=4, logical_pages=16, max_num_seqs=6,
              max_num_batched_tokens=24, max_prefill_chunk=10)
    core, twin = qualia.StepScheduler(**kw), _twin(**kw)
    _add_requests(core, seed=5, n=12)
    _add_requests(twin, seed=5, n=12)
    if kind == "hash":
        c_backend, py_backend = qualia.HashBackend(vocab=777), PyHashBackend(vocab=777)
    else:
        c_backend, py_backend = example_backend.new_step(777), PyExampleStep(777)
    got, want = core.run(c_backend), twin.run(py_backend)
    assert [(f.request_id, f.output_tokens.tolist(), f.finish_reason) for f in got.finished] == \
        [(f.request_id, f.output_tokens.tolist(), f.finish_reason) for f in want.finished]
    assert len(got.finished) == 12 and not core.has_unfinished()
    assert int(want.stats["num_preempted"].sum()) > 0
