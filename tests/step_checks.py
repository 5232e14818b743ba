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


class ShadowKV:
    """What a backend's paged KV holds, one token id per slot (-1: never written), to check the
    plans' page bookkeeping without a model: executing a plan performs its copies (all at once:
    a plan's copies have distinct destinations and no destination is a source, so any order
    gives the same pages), writes each scheduled token at its ``slot_mapping``, then reads every
    scheduled request's ``seq_lens`` positions through ``kv_indices`` and checks that they hold
    the request's tokens.  ``expect`` snapshots those tokens when the plan is made (a request
    aborted afterwards is still read by the executing kernel)."""

    def __init__(self, num_pages, page_tokens):
        self.kv = np.full((max(num_pages, 1), page_tokens), -1, dtype=np.int64)
        self.pt = page_tokens

    @staticmethod
    def expect(sched, plan):
        return [sched.request_tokens(int(r))[:int(n)].tolist()
                for r, n in zip(plan.request_ids, plan.seq_lens)]

    def copy(self, copies):
        src = copies["src_page"].astype(np.int64)
        dst = copies["dst_page"].astype(np.int64)
        assert len(set(dst.tolist())) == len(dst), ("copies share a destination", copies)
        assert not set(dst.tolist()) & set(src.tolist()), ("a destination is a source", copies)
        self.kv[dst] = self.kv[src]

    def write(self, plan, rows=None):
        sm = np.asarray(plan.slot_mapping, dtype=np.int64)
        ids = np.asarray(plan.input_ids, dtype=np.int64)
        if rows is not None:
            sm, ids = sm[rows], ids[rows]
        self.kv[sm // self.pt, sm % self.pt] = ids

    def execute(self, plan, expected):
        """A whole execution: copies, writes, then every read checked."""
        self.copy(plan.copies)
        self.write(plan)
        ptr, idx = plan.kv_indptr.tolist(), plan.kv_indices.tolist()
        for j, tokens in enumerate(expected):
            pages = idx[ptr[j]:ptr[j + 1]]
            got = [int(self.kv[pages[p // self.pt], p % self.pt]) for p in range(len(tokens))]
            assert got == tokens, (f"request {int(plan.request_ids[j])} reads other K/V than "
                                   f"its tokens", got, tokens, plan.copies)

    def fail(self, plan, how, rng):
        """An execution that failed part way ("none", "copies": some of the copies, "writes":
        the copies and some writes, "full": everything, then the backend reported failure)."""
        if how == "none":
            return
        if how == "copies":
            self.copy(plan.copies[:int(rng.integers(0, len(plan.copies) + 1))])
            return
        self.copy(plan.copies)
        if how == "writes":
            self.write(plan, rng.random(len(plan.input_ids)) < 0.5)
        else:
            self.write(plan)
