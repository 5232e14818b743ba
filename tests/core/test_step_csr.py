"""The paged-KV CSR form on request (docs/DESIGN.md, "The plan", "The CSR form on request"): a
StepPlan builds ``kv_indptr`` / ``kv_indices`` / ``kv_last_page_len`` on their first read, while
the plan is pending; a C step backend gets them unless it declares ``QUALIA_STEP_NO_CSR``, and
then gets none (NULL pointers, no indices).  Either way the pages a backend reads through the
CSR form are its block-table row's, for every plan of a workload with preemption, forks and
aborts."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers.ctypes_abi import EXECUTE_STEP, c_array, step_capsule

import qualia
from qualia import StepError, _core

PT = 4


def make(**kw):
    kw.setdefault("cache_key", b"c" * 16)
    kw.setdefault("max_num_batched_tokens", 24)
    return qualia.StepScheduler(kw.pop("num_pages", 40), PT, 12, 4, **kw)


def ids(plan):
    return np.array([(int(plan.input_ids[r]) * 7 + 3) % 50 for r in plan.logits_indices],
                    dtype=np.uint32)


def workload(s):
    for i in range(6):
        s.add_request(i, [(i * 5 + k) % 40 + 1 for k in range(5 + 3 * i)], max_new_tokens=9,
                      n=2 if i == 3 else 1)


def expected_csr(plan):
    """The CSR form from the dense block table, the rows and seq_lens."""
    ptr, idx, last = [0], [], []
    for row, seq in zip(plan.block_table_rows.tolist(), plan.seq_lens.tolist()):
        pages = -(-seq // PT)
        idx += plan.block_table[row, :pages].tolist()
        ptr.append(len(idx))
        last.append(seq - (pages - 1) * PT)
    return ptr, idx, last


def test_the_csr_form_is_built_on_its_first_read_while_the_plan_is_pending():
    s = make()
    workload(s)
    steps = 0
    while s.has_unfinished():
        plan = s.schedule()
        if steps % 3 == 0:
            # never read while pending: the form is not there to read once the plan is applied
            s.update(ids(plan))
            with pytest.raises(StepError.NoPlan, match="while the plan is pending"):
                _ = plan.kv_indices
            with pytest.raises(StepError.NoPlan):
                _ = plan.kv_indptr
        else:
            if steps % 3 == 1 and len(plan.request_ids) > 1:
                s.abort(int(plan.request_ids[-1]))      # its row stays until the plan retires
            want = expected_csr(plan)
            got = (plan.kv_indptr.tolist(), plan.kv_indices.tolist(),
                   plan.kv_last_page_len.tolist())
            assert got == want
            assert plan.kv_indices.dtype == np.int32 and not plan.kv_indices.flags.writeable
            s.update(ids(plan))
            # read once while pending: the same arrays until the next schedule()
            assert (plan.kv_indptr.tolist(), plan.kv_indices.tolist(),
                    plan.kv_last_page_len.tolist()) == want
        steps += 1
    # an older plan's form cannot be built once a later plan is pending
    s.add_request(99, [1, 2, 3], max_new_tokens=2)
    old = s.schedule()
    s.update(ids(old))
    s.schedule()
    with pytest.raises(StepError.NoPlan):
        _ = old.kv_last_page_len


def recording_backend(flags, seen):
    """A C step backend (ctypes) that samples by the rule of ids() and records, per step, the
    CSR form it was handed (None when the pointers are NULL) and the form the dense block table
    gives."""

    @EXECUTE_STEP
    def execute(ctx, p, out, logprobs):
        c = p.contents
        n = c.num_requests
        rows = c_array(ctypes.c_int32, c.block_table_rows, n)
        seqs = c_array(ctypes.c_int32, c.seq_lens, n)
        table = c_array(ctypes.c_int32, c.block_table,
                        c.block_table_num_rows * c.block_table_row_stride)
        want = [0], [], []
        for row, seq in zip(rows, seqs):
            pages = -(-seq // PT)
            want[1].extend(table[row * c.block_table_row_stride:][:pages])
            want[0].append(len(want[1]))
            want[2].append(seq - (pages - 1) * PT)
        if c.kv_indptr is None and c.kv_indices is None and c.kv_last_page_len is None:
            got = None if c.num_kv_indices == 0 else "count without arrays"
        else:
            got = (c_array(ctypes.c_int32, c.kv_indptr, n + 1),
                   c_array(ctypes.c_int32, c.kv_indices, c.num_kv_indices),
                   c_array(ctypes.c_int32, c.kv_last_page_len, n))
        seen.append((got, tuple(want)))
        tokens = c_array(ctypes.c_uint32, c.input_ids, c.num_tokens)
        logits = c_array(ctypes.c_int32, c.logits_indices, c.num_sampled)
        arr = (ctypes.c_uint32 * max(c.num_sampled, 1)).from_address(out)
        for r, t in enumerate(logits):
            arr[r] = (tokens[t] * 7 + 3) % 50
        return 0
    return step_capsule(execute, flags)


class Capsule:
    def __init__(self, cap):
        self.__qualia_step_backend__ = cap


@pytest.mark.parametrize("flags", [0, _core.STEP_NO_CSR])
def test_a_c_backend_gets_the_csr_form_unless_it_declares_no_csr(flags):
    seen = []
    s, ref = make(num_pages=14), make(num_pages=14)   # small: preemptions
    workload(s)
    workload(ref)
    got = s.run(Capsule(recording_backend(flags, seen)))
    want = []
    while ref.has_unfinished():
        want.extend(ref.update(ids(ref.schedule())))
    assert repr(got.finished) == repr(want)
    assert got.totals["num_preempted"] > 0
    assert len(seen) == got.steps
    for csr, dense in seen:
        assert csr == (None if flags else dense)
