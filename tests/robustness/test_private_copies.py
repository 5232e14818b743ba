"""User code runs before a call reads what it was given, never while it reads (docs/DESIGN.md,
"Ownership").

A call reads its arguments' values from a private copy made while resolving them: an ndarray
subclass is read as an ndarray (none of its own methods run), and the items of a sequence are
read from a tuple, which no `__index__` can shrink, whatever lists it reaches (`gc` hands it
every list that refers to it).  A scheduler the cycle collector frees hands its pool back like
one freed by its last reference.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import qualia


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
