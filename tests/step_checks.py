"""The one check that two engine-step plans (the core's and the twin's) are the same, array for
array and count for count; the step tests and the stateful differential test share it."""

import numpy as np

PLAN_ARRAYS = ("request_ids", "query_start_loc", "seq_lens", "input_ids", "positions",
               "slot_mapping", "logits_indices", "sampled_request_ids", "block_table",
               "block_table_rows", "changed_rows", "kv_indptr", "kv_indices", "kv_last_page_len",
               "copies", "new_request_ids", "preempted_request_ids", "finished_request_ids",
               "fork_child_ids", "fork_parent_ids")
PLAN_COUNTS = ("num_prefill_tokens", "num_decode_tokens", "num_cached_tokens", "page_tokens",
               "num_seqs", "num_tokens")


def assert_same_plan(a, b):
    for name in PLAN_ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, (name, x, y)
        assert np.array_equal(x, y), (name, x, y)
    for name in PLAN_COUNTS:
        assert getattr(a, name) == getattr(b, name), name
    # beam rows (a plan type without them has none)
    assert getattr(a, "num_topk", 0) == getattr(b, "num_topk", 0), "num_topk"
