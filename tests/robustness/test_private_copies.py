"""User code runs before a call reads what it was given, never while it reads (docs/DESIGN.md,
"Ownership").

A call reads its arguments' values from a private copy made while resolving them: an ndarray
subclass is read as an ndarray (none of its own methods run), and the items of a sequence are
read from a tuple, which no `__index__` can shrink, whatever lists it reaches (`gc` hands it
every list that refers to it).  A Python plan lowered for a C step backend is copied before it
is checked, so what the backend reads is what was checked.  A scheduler the cycle collector
frees hands its pool back like one freed by its last reference.
"""

from __future__ import annotations

import ctypes
import gc
import types
import warnings

import numpy as np
import pytest
from helpers.ctypes_abi import EXECUTE_STEP, step_capsule

import qualia
from qualia import _core, twin


class NoMethods(np.ndarray):
    """An ndarray whose own value methods must never be called by the core."""

    def tolist(self):
        raise AssertionError("the core called the subclass's tolist")

    def min(self, *a, **k):
        raise AssertionError("the core called the subclass's min")

    def max(self, *a, **k):
        raise AssertionError("the core called the subclass's max")


class Shrinker:
    """A token whose __index__ empties every list that refers to it, then answers `value`."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        for r in gc.get_referrers(self):
            if type(r) is list:
                r.clear()
        return self.value


def step_with_one_request():
    s = qualia.StepScheduler(16, 4, 8, 4)
    s.add_request(1, [1, 2, 3], max_new_tokens=4)
    return s, s.schedule()


def test_update_reads_an_ndarray_subclass_as_an_ndarray():
    s, plan = step_with_one_request()
    assert len(plan.logits_indices) == 1
    s.update(np.array([7], np.int64).view(NoMethods))
    assert s.request_tokens(1).tolist() == [1, 2, 3, 7]


def test_update_refuses_a_subclass_holding_what_a_list_may_not():
    s, _ = step_with_one_request()
    with pytest.raises(TypeError):
        s.update(np.array([True]).view(NoMethods))
    with pytest.raises(ValueError):
        s.update(np.array([-1], np.int64).view(NoMethods))
    s.update([7])   # the plan is still pending: the refused calls changed nothing
    assert s.request_tokens(1).tolist() == [1, 2, 3, 7]


def test_run_reads_a_python_backend_subclass_result_as_an_ndarray():
    class Backend:
        def execute_step(self, plan):
            return np.full(len(plan.logits_indices), 5, np.int64).view(NoMethods)

    s = qualia.StepScheduler(16, 4, 8, 4)
    s.add_request(1, [1, 2, 3], max_new_tokens=2)
    s.run(Backend())
    assert s.requests() == []


@pytest.mark.parametrize("call", ["add_request", "page_identities", "of_tokens"])
def test_a_token_emptying_the_lists_it_is_in_changes_nothing_read(call):
    def tokens():
        return (x for x in [Shrinker(1)] + [2] * 20)   # a generator: no list of the caller's

    plain = [1] + [2] * 20
    s = qualia.StepScheduler(16, 4, 8, 4)
    if call == "add_request":
        s.add_request(1, tokens(), max_new_tokens=4)
        assert s.request_tokens(1).tolist() == plain
    elif call == "page_identities":
        assert s.page_identities(tokens()).tolist() == s.page_identities(plain).tolist()
    else:
        assert qualia.PrefixIdentity.of_tokens(tokens()) == qualia.PrefixIdentity.of_tokens(plain)


def test_tokens_of_a_subclass_lying_about_its_range_are_refused():
    s = qualia.StepScheduler(16, 4, 8, 4)
    with pytest.raises(OverflowError):
        s.add_request(1, np.array([2**32 + 5, 7], np.int64).view(NoMethods), max_new_tokens=4)
    assert s.requests() == []


def test_the_router_reads_identities_of_a_subclass_and_a_shrinking_list_privately():
    r = qualia.PrefixRouterIndex(64, 4)
    base = np.array([11, 12, 13], np.int64)
    assert r.match(base.view(NoMethods)).tolist() == r.match(base).tolist()
    assert r.match([Shrinker(11), 12, 13]).tolist() == r.match(base).tolist()


def test_a_table_reads_pages_of_a_subclass_and_a_shrinking_list_privately():
    pool = qualia.BlockPool(16)
    pages = [pool.allocate() for _ in range(3)]
    t = qualia.SequenceBlockTable(16)
    t.attach(np.array(pages, np.int64).view(NoMethods), pool)
    u = qualia.SequenceBlockTable(16)
    u.attach([Shrinker(pages[0])] + pages[1:], pool)
    assert list(t.entries()) == list(u.entries()) == pages


def test_a_receipt_emptied_by_its_own_first_item_is_read_whole():
    class Backend:
        def execute_ragged(self, items, block_table, outputs):
            for i in range(len(items)):
                outputs[i]["request_id"] = items[i]["request_id"]
                outputs[i]["slot"] = items[i]["slot"]
                outputs[i]["next_token_id"] = 5
            receipt = [Shrinker(len(items)), 1]
            return receipt

    s = qualia.Scheduler(4, 16, 4, 8)
    s.admit(1, [1, 2, 3])
    s.reserve(1, 3)
    s.advance(1, 3)
    s.complete_prefill(1, 9)
    receipt, out = s.decode(Backend())
    assert (receipt.batch_size, receipt.backend_launches) == (1, 1)
    assert out["next_token_id"].tolist() == [5]


def test_plan_scalars_run_before_its_arrays_are_checked():
    # a num_prefill_tokens whose __index__ rewrites a checked array: the check sees the rewrite
    s = qualia.StepScheduler(16, 4, 8, 4)
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=2)
    p = s.schedule()

    class Plan:
        pass

    plan = Plan()
    for name in ("request_ids", "query_start_loc", "seq_lens", "input_ids", "positions",
                 "slot_mapping", "logits_indices", "sampled_request_ids", "block_table",
                 "block_table_rows", "changed_rows", "kv_indptr", "kv_indices",
                 "kv_last_page_len", "copies"):
        setattr(plan, name, np.array(getattr(p, name)))
    plan.page_tokens = p.page_tokens
    plan.num_prefill_tokens, plan.num_decode_tokens = p.num_prefill_tokens, p.num_decode_tokens
    backend = qualia.HashBackend(50)
    honest = backend.execute_step(plan).tolist()

    class Rewrites:
        def __index__(self):
            plan.block_table_rows[0] = 50_000_000
            return 0

    plan.num_prefill_tokens = Rewrites()
    with pytest.raises(ValueError, match="block_table_rows"):
        backend.execute_step(plan)
    plan.block_table_rows[0] = p.block_table_rows[0]
    plan.num_prefill_tokens = p.num_prefill_tokens
    assert backend.execute_step(plan).tolist() == honest


@pytest.mark.parametrize("in_cycle", [False, True])
def test_a_collected_scheduler_hands_its_pool_back(in_cycle):
    s = qualia.StepScheduler(8, 4, 4, 2)
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=2)
    s.schedule()
    pool = s.pool
    if in_cycle:
        junk = [s]
        junk.append(junk)      # s is reachable from a garbage cycle only
        del junk
    del s
    gc.collect()
    assert pool.free_count == 8
    assert pool.allocate() in range(8)


PLAN_ARRAYS = ("request_ids", "query_start_loc", "seq_lens", "input_ids", "positions",
               "slot_mapping", "logits_indices", "sampled_request_ids", "block_table",
               "block_table_rows", "changed_rows", "kv_indptr", "kv_indices", "kv_last_page_len",
               "copies")


def plan_and_backend():
    # a plan of one prefilling request as writable copies, and a ctypes C step backend that
    # records the kv_indptr and block_table_rows it reads
    s = qualia.StepScheduler(16, 4, 8, 4)
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=2)
    p = s.schedule()
    plan = types.SimpleNamespace(**{k: np.array(getattr(p, k)) for k in PLAN_ARRAYS})
    plan.page_tokens = p.page_tokens
    plan.num_prefill_tokens, plan.num_decode_tokens = p.num_prefill_tokens, p.num_decode_tokens
    seen = {}

    @EXECUTE_STEP
    def execute(ctx, cplan, sampled, logprobs):
        c = cplan.contents
        seen["kv_indptr"] = [ctypes.c_int32.from_address(c.kv_indptr + 4 * i).value
                             for i in range(c.num_requests + 1)]
        seen["block_table_rows"] = [
            ctypes.c_int32.from_address(c.block_table_rows + 4 * i).value
            for i in range(c.num_requests)]
        for r in range(c.num_sampled):
            ctypes.c_uint32.from_address(sampled + 4 * r).value = 7
        return 0

    return plan, step_capsule(execute), seen   # the capsule keeps the callback alive


def test_an_output_array_sharing_a_plan_array_cannot_change_what_the_backend_reads():
    plan, cap, seen = plan_and_backend()
    checked = plan.kv_indptr.tolist()
    assert len(plan.logits_indices) == 1
    # the sampled ids go where kv_indptr lies: every row is set to 2**32 - 1 before the call
    _core._call_step_backend(cap, plan, sampled_out=plan.kv_indptr.view(np.uint32))
    assert seen["kv_indptr"] == checked


def test_a_gc_callback_changing_the_plan_cannot_slip_past_its_checks():
    # a collection at every allocation; a first call counts those before the backend runs, a
    # second one's callback writes out-of-range values into the plan's arrays at the last of
    # them (the one nearest the backend call): refused by a check, or never read
    count, target, tampered = [0], [None], []

    def hook(phase, info):
        if phase == "start" and not seen:
            count[0] += 1
            if count[0] == target[0]:
                plan.block_table_rows[0] = 50_000_000
                plan.kv_indptr[0] = -5
                tampered.append(True)

    old = gc.get_threshold()
    gc.callbacks.append(hook)
    try:
        for attempt in range(2):
            plan, cap, seen = plan_and_backend()
            honest = (plan.kv_indptr.tolist(), plan.block_table_rows.tolist())
            count[0] = 0
            gc.set_threshold(1)
            try:
                _core._call_step_backend(cap, plan)
                refused = False
            except ValueError:
                refused = True
            finally:
                gc.set_threshold(*old)
            if attempt == 0:
                assert not refused and count[0] > 0
                target[0] = count[0]
            elif refused:
                assert not seen     # a check refused the plan: the backend never ran
            else:
                assert (seen["kv_indptr"], seen["block_table_rows"]) == honest
        assert tampered
    finally:
        gc.callbacks.remove(hook)


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_sampled_ids_changed_by_a_candidate_array_hook_are_read_as_changed(change):
    s, _ = step_with_one_request()
    ids = np.array([7], np.uint32)

    class Candidates:   # the plan has no beam rows: converted, then ignored
        def __array__(self, dtype=None, copy=None):
            if change == "dtype":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ids.dtype = np.int32
            else:
                ids.shape = (1, 1)
            return np.zeros((1, 1))

    if change == "dtype":
        s.update(ids, topk_ids=Candidates(), topk_logprobs=np.zeros((1, 1)))
        assert s.request_tokens(1).tolist() == [1, 2, 3, 7]
    else:
        with pytest.raises(ValueError, match="1-D"):
            s.update(ids, topk_ids=Candidates(), topk_logprobs=np.zeros((1, 1)))
        assert s.request_tokens(1).tolist() == [1, 2, 3]


def test_a_c_backend_changing_its_own_struct_mid_run_is_called_as_it_was_checked():
    from helpers import ctypes_abi

    s = qualia.StepScheduler(32, 4, 8, 4, vocab_size=64)
    s.add_request(1, [1, 2, 3, 4, 5], max_new_tokens=6)

    @EXECUTE_STEP
    def execute(ctx, cplan, sampled, logprobs):
        iface.execute_step = None       # its own struct: the core called a copy
        for r in range(cplan.contents.num_sampled):
            ctypes.c_uint32.from_address(sampled + 4 * r).value = 5
        return 0

    cap = step_capsule(execute)
    iface = ctypes_abi._CAPSULES[-1][0]
    result = s.run(cap)
    assert [f.output_tokens.tolist() for f in result.finished] == [[5] * 6]


@pytest.mark.parametrize("impl", [qualia.StepScheduler, twin.StepScheduler])
@pytest.mark.parametrize("requests", [1, 2, 3])
def test_a_python_backend_may_return_its_ids_as_a_tuple_of_ints(impl, requests):
    # a tuple is (ids, topk_ids, topk_logprobs) only when its first item is not an integer: a
    # tuple of three ids is three ids (and an empty tuple none)
    hb = qualia.HashBackend(64)

    class TupleIds:
        def execute_step(self, plan):
            return tuple(int(x) for x in hb.execute_step(plan))

    def finish(backend):
        s = impl(32, 4, 8, 4, vocab_size=64)
        for i in range(requests):
            s.add_request(i, [1, 2, 3][:3 - i], max_new_tokens=2)
        return sorted((f.request_id, f.output_tokens.tolist()) for f in s.run(backend).finished)

    assert finish(TupleIds()) == finish(hb)
