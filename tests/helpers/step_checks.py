"""The checks the core and the twin are held to, shared by the step tests and the stateful
differential tests: two engine-step plans are the same, array for array and count for count;
two schedulers report the same counters; two ``run()`` results are the same.  The counters are
read through the names the compiled core and the twin share, whichever class carries them."""

import numpy as np

from qualia.twin import StepScheduler

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


def namespace_table(s):
    """The namespace table of a scheduler with automatic prefix caching (the ``_debug_namespaces``
    hook: every id in use with its name, references and reclaimable pages, and the idle ids in
    the order they give their ids up), or None with another mode."""
    cache = getattr(s, "facade", s)    # the twin's engine step keeps its cache in its facade
    if cache.prefix_caching != "auto":
        return None
    rows, idle = s._debug_namespaces()
    return {"rows": rows, "idle": idle}


def facade_counters(s):
    """Every counter of an admit/decode/finish scheduler: ``stats()`` (pages free, used, cached,
    reclaimable, copied and allocated, decode rounds, ...), ``cache_stats()`` (lookups, hits,
    reclaims, pages stored, duplicates, collisions, hashed, KV events pending and dropped,
    namespaces, usage) and, with automatic caching, the namespace table."""
    out = {"stats": s.stats(), "cache_stats": s.cache_stats()._asdict()}
    table = namespace_table(s)
    if table is not None:
        out["namespaces"] = table
    return out


def step_counters(s):
    """Every counter of an engine-step scheduler: its ``stats()`` and ``cache_stats()``, the
    fork counters (``forks``, ``fork_fallbacks``, ``parked``) and the queues."""
    out = facade_counters(s)
    out["step"] = {"forks": s.forks, "fork_fallbacks": s.fork_fallbacks, "parked": s.parked,
                   "num_waiting": s.num_waiting, "num_running": s.num_running,
                   "has_unfinished": s.has_unfinished(), "free_pages": s.free_pages}
    return out


def _assert_same(a, b):
    for part in a.keys() | b.keys():
        x, y = a.get(part), b.get(part)
        assert x is not None and y is not None, (part, x, y)
        for name in x.keys() | y.keys():
            assert name in x and name in y, (part, name, "reported by one only")
            assert x[name] == y[name], (part, name, x[name], y[name])


def assert_same_facade_counters(core, twin):
    _assert_same(facade_counters(core), facade_counters(twin))


def assert_same_step_counters(core, twin):
    _assert_same(step_counters(core), step_counters(twin))


def assert_same_run(a, b):
    """Two run results (``RunResult``): the ``STEP_STATS`` rows kept, the steps, the ``STEP_TOTALS``
    sums and the finished requests and groups, in order."""
    assert a.stats.dtype == b.stats.dtype, (a.stats.dtype, b.stats.dtype)
    assert np.array_equal(a.stats, b.stats), (a.stats, b.stats)
    assert a.steps == b.steps and a.totals == b.totals, (a.steps, b.steps, a.totals, b.totals)
    assert finished_key(a.finished) == finished_key(b.finished)


def finished_key(done):
    """Finished requests (``FinishedRequest``) and groups (``FinishedGroup``) as comparable
    values, dtypes included."""
    return [(f.request_id, f.output_tokens.dtype, f.output_tokens.tolist(), f.finish_reason)
            if hasattr(f, "output_tokens") else
            (type(f).__name__, f.request_id, [(o.dtype, o.tolist()) for o in f.outputs],
             f.finish_reasons, f.scores, f.member_ids)
            for f in done]


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

    def forget(self):
        """Plans ran that the shadow did not see (a ``run()`` with a C backend): from here on
        it checks nothing."""
        self.kv = None

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
        if self.kv is None:
            return
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
        if how == "none" or self.kv is None:
            return
        if how == "copies":
            self.copy(plan.copies[:int(rng.integers(0, len(plan.copies) + 1))])
            return
        self.copy(plan.copies)
        if how == "writes":
            self.write(plan, rng.random(len(plan.input_ids)) < 0.5)
        else:
            self.write(plan)


def run_steps(sched, backend, max_steps=100000):
    """Drive ``sched`` to completion one schedule/update at a time (a backend's
    ``execute_step`` returns the sampled ids, or ``(sampled, topk_ids, topk_logprobs)`` for a
    plan with beam rows); returns (finished, peak pages held by requests, steps).  Pages are
    counted after each ``schedule`` (the step's pages are reserved then)."""
    finished = []
    peak = 0
    steps = 0
    while sched.has_unfinished() and steps < max_steps:
        plan = sched.schedule()
        stats = sched.stats()
        peak = max(peak, stats["used_pages"])
        out = backend.execute_step(plan)
        finished.extend(sched.update(*out) if isinstance(out, tuple) else sched.update(out))
        steps += 1
    return finished, peak, steps


def state_snapshot(s):
    """Everything a failed call must leave as it was (core or twin)."""
    if isinstance(s, StepScheduler):
        f = s.facade
        reqs = list(s.requests())
        return {"requests": reqs, "tokens": {r: s.request_tokens(r).tolist() for r in reqs},
                "waiting": s.num_waiting, "running": s.num_running, "free": f.free_pages,
                "refcounts": [f.pool.refcount(p) for p in range(f.num_pages)],
                "pending": s._plan is not None}
    reqs = s.requests()
    return {"requests": reqs, "tokens": {r: s.request_tokens(r).tolist() for r in reqs},
            "waiting": s.num_waiting, "running": s.num_running, "free": s.free_pages,
            "refcounts": s.pool.refcounts().tolist(), "cache": s.cache_stats(),
            "stats": s.stats(), "reclaimable": s.reclaimable_pages().tolist(),
            "active": s.active_count}


def example_rule(plan, vocab):
    """examples/c_backend's step model, in Python."""
    out = []
    for t in plan.logits_indices.tolist():
        i = int(np.searchsorted(plan.query_start_loc, t, side="right")) - 1
        pages = plan.kv_indices[plan.kv_indptr[i]: plan.kv_indptr[i + 1]].astype(np.uint64)
        out.append((31 * int(plan.input_ids[t]) + int(plan.positions[t]) + int(plan.seq_lens[i])
                    + int(pages.sum())) % vocab)
    return np.array(out, np.uint32)


def example_topk_rule(plan, vocab, k):
    """examples/c_backend's beam candidates, in Python: (sampled, topk_ids, topk_logprobs) with
    row r's candidate j = (next + j) % vocab at log-probability (-next / vocab) - j in float32."""
    ids = example_rule(plan, vocab)
    j = np.arange(k, dtype=np.uint64)
    tids = ((ids.astype(np.uint64)[:, None] + j[None, :]) % vocab).astype(np.uint32)
    lp = -ids.astype(np.float32) / np.float32(vocab)
    return ids, tids, lp[:, None] - j.astype(np.float32)[None, :]
