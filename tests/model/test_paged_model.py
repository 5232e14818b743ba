"""The numpy test transformer (qualia.model): paged backend (prefix sharing, copy-on-write, page
reuse, preemption/recompute, ragged batched decode) against the dense model, token for token.

No dependency on the scheduler core: a tiny page allocator lives in this file.
"""

from __future__ import annotations

import numpy as np
import pytest

from qualia.model import DenseModel, ModelConfig, ModelWeights, PagedModelBackend

# DESIGN.md "C layouts" by hand (the package will ship the same as qualia.RAGGED_BATCH_ITEM ...)
ITEM = np.dtype(
    {
        "names": [
            "request_id", "slot", "token_id", "position",
            "block_table_offset", "logical_pages", "_reserved",
        ],
        "formats": ["<u8", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4"],
        "offsets": [0, 8, 12, 16, 20, 24, 28],
        "itemsize": 32,
    }
)
OUTPUT = np.dtype(
    {
        "names": ["request_id", "slot", "next_token_id"],
        "formats": ["<u8", "<u4", "<u4"],
        "offsets": [0, 8, 12],
        "itemsize": 16,
    }
)
COPY_OP = np.dtype(
    {"names": ["src_page", "dst_page"], "formats": ["<u4", "<u4"], "offsets": [0, 4], "itemsize": 8}
)

CONFIG = ModelConfig()  # layers=2, heads=4, head_dim=16, vocab=512, seed=0


@pytest.fixture(scope="module")
def weights():
    return ModelWeights.random(CONFIG)


@pytest.fixture(scope="module")
def dense(weights):
    return DenseModel(weights)


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab, n).tolist()


# ------------------------------------------------------------------------------------------
# test-side paging: a pool with refcounts (LIFO free stack) and per-request block tables
# ------------------------------------------------------------------------------------------


class Pool:
    def __init__(self, n):
        self.refs = [0] * n
        self.free = list(range(n - 1, -1, -1))  # pop() -> 0, 1, 2, ...
        self.ever_allocated = set()
        self.reused = 0

    def allocate(self):
        page = self.free.pop()
        assert self.refs[page] == 0
        if page in self.ever_allocated:
            self.reused += 1
        self.ever_allocated.add(page)
        self.refs[page] = 1
        return page

    def retain(self, page):
        assert self.refs[page] > 0
        self.refs[page] += 1

    def release(self, page):
        assert self.refs[page] > 0
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)


class Req:
    def __init__(self, rid, slot, prompt, max_new):
        self.rid, self.slot, self.prompt, self.max_new = rid, slot, list(prompt), max_new
        self.pages = []  # logical -> physical
        self.count = 0  # positions whose K/V is written
        self.generated = []

    @property
    def done(self):
        return len(self.generated) >= self.max_new


class Engine:
    """Drives PagedModelBackend the way DESIGN.md "Driving the scheduler" describes."""

    def __init__(self, weights, num_blocks, page_tokens):
        self.backend = PagedModelBackend(weights, num_blocks, page_tokens)
        self.pool = Pool(num_blocks)
        self.pt = page_tokens
        self.prefixes = {}  # name -> (pages, tokens)
        self.cow = 0

    # ensure_writable (DESIGN.md "Sequence block table and copy-on-write"); a copy op or None
    def writable(self, req, logical):
        assert logical <= len(req.pages)
        if logical == len(req.pages):
            req.pages.append(self.pool.allocate())
            return None
        page = req.pages[logical]
        if self.pool.refs[page] == 1:
            return None
        dst = self.pool.allocate()
        self.pool.release(page)
        req.pages[logical] = dst
        self.cow += 1
        return (page, dst)

    def copy(self, ops):
        if ops:
            arr = np.array(ops, dtype=COPY_OP)
            before = self.backend.pages_copied
            self.backend.copy_pages(arr)
            assert self.backend.pages_copied == before + len(ops)

    def prefill(self, req, tokens):
        """Prefill ``tokens`` at positions req.count.. (pages made writable first)."""
        start = req.count
        ops = []
        for p in range(start, start + len(tokens)):
            if p == start or p % self.pt == 0:
                op = self.writable(req, p // self.pt)
                if op:
                    ops.append(op)
        self.copy(ops)
        bt = np.array(req.pages, dtype=np.uint32)
        bt.flags.writeable = False
        nxt = self.backend.prefill(tokens, start, bt)
        req.count += len(tokens)
        return nxt

    def admit(self, req, prefix=None):
        if prefix is not None:
            pages, tokens = self.prefixes[prefix]
            for page in pages:
                self.pool.retain(page)
            req.pages = list(pages)
            req.count = tokens
        if req.count < len(req.prompt):
            first = self.prefill(req, req.prompt[req.count :])
        else:
            # the prefix covers the whole prompt: recompute the last prompt token (its page is
            # shared, so this is a copy-on-write) to get the first generated token
            req.count -= 1
            first = self.prefill(req, req.prompt[-1:])
        req.generated.append(first)
        return first

    def publish(self, name, req, tokens):
        pages = req.pages[: -(-tokens // self.pt)]
        for page in pages:
            self.pool.retain(page)
        self.prefixes[name] = (list(pages), tokens)

    def unpublish(self, name):
        pages, _ = self.prefixes.pop(name)
        for page in pages:
            self.pool.release(page)

    def free(self, req):
        for page in req.pages:
            self.pool.release(page)
        req.pages = []
        req.count = 0

    def preempt_and_recompute(self, req):
        """Drop every page, then re-prefill prompt + generated from scratch."""
        self.free(req)
        nxt = self.prefill(req, req.prompt + req.generated)
        req.generated.append(nxt)

    def decode_round(self, reqs):
        reqs = [r for r in reqs if not r.done]
        if not reqs:
            return 0
        ops = []
        for r in reqs:
            op = self.writable(r, r.count // self.pt)
            if op:
                ops.append(op)
        self.copy(ops)
        # ragged flat block table, deliberately padded between requests and in a scrambled order
        order = list(reversed(reqs))
        flat, offsets = [7777], {}
        for r in order:
            offsets[r.rid] = len(flat)
            flat.extend(r.pages)
            flat.append(4242)  # junk the backend must not read
        items = np.zeros(len(reqs), dtype=ITEM)
        for i, r in enumerate(reqs):
            items[i] = (r.rid, r.slot, r.generated[-1], r.count, offsets[r.rid], len(r.pages), 0)
        table = np.array(flat, dtype=np.uint32)
        items_before, table_before = items.tobytes(), table.tobytes()
        items.flags.writeable = False
        table.flags.writeable = False
        outputs = np.zeros(len(reqs), dtype=OUTPUT)
        rounds = self.backend.rounds
        receipt = self.backend.execute_ragged(items, table, outputs)
        assert tuple(receipt) == (len(reqs), 1)
        assert self.backend.rounds == rounds + 1
        assert items.tobytes() == items_before and table.tobytes() == table_before
        for i, r in enumerate(reqs):
            assert int(outputs["request_id"][i]) == r.rid
            assert int(outputs["slot"][i]) == r.slot
            r.generated.append(int(outputs["next_token_id"][i]))
            r.count += 1
        return len(reqs)


# ------------------------------------------------------------------------------------------


def test_layouts_have_the_abi_sizes():
    assert (ITEM.itemsize, OUTPUT.itemsize, COPY_OP.itemsize) == (32, 16, 8)


def test_weights_deterministic():
    a, b = ModelWeights.random(ModelConfig(seed=3)), ModelWeights.random(ModelConfig(seed=3))
    assert a.equal(b)
    assert all(x.dtype == np.float64 for x in a.arrays())
    c = ModelWeights.random(ModelConfig(seed=4))
    assert not a.equal(c)
    prompt = _prompt(0, 12)
    assert DenseModel(a).generate(prompt, 20) == DenseModel(b).generate(prompt, 20)
    assert DenseModel(a).generate(prompt, 20) != DenseModel(c).generate(prompt, 20)


def test_incremental_matches_batched_causal_forward(weights, dense):
    """The per-token path is a causal transformer: agrees with a one-pass batched forward."""
    prompt = _prompt(1, 30)
    out = dense.generate(prompt, 25)
    seq = dense.sequence()
    inc = np.array([seq.feed_logits([t]) for t in prompt + out[:-1]])
    full = weights.full_forward_logits(prompt + out[:-1])
    np.testing.assert_allclose(inc, full, rtol=0, atol=1e-9)
    assert full[len(prompt) - 1 :].argmax(axis=1).tolist() == out
    # context matters: the output is not a function of the last token alone
    assert len(set(out)) > 5


def test_dense_generate_end_token_and_incremental(dense):
    prompt = _prompt(2, 10)
    out = dense.generate(prompt, 40)
    assert len(out) == 40 and dense.generate(prompt, 0) == []
    k = 7
    end = out[k]
    first = out.index(end)
    assert dense.generate(prompt, 40, eos_token_id=end) == out[: first + 1]
    toks = [dense.start(prompt)]
    while len(toks) < 40:
        toks.append(dense.step(toks[-1]))
    assert toks == out


def test_paged_single_request_bit_identical(weights, dense):
    prompt = _prompt(3, 37)
    eng = Engine(weights, num_blocks=16, page_tokens=8)
    r = Req(rid=5, slot=0, prompt=prompt, max_new=30)
    # scramble physical placement: take a few pages first so the request's pages are not 0..n
    hold = [eng.pool.allocate() for _ in range(3)]
    assert hold == [0, 1, 2]
    logits = eng.backend.prefill_logits(prompt, 0, np.array([15, 3, 9, 4, 12], np.uint32))
    assert np.array_equal(logits, dense.prompt_logits(prompt))  # bit for bit
    eng.admit(r)
    while not r.done:
        eng.decode_round([r])
    assert r.generated == dense.generate(prompt, 30)


def test_mixed_workload_matches_dense(weights, dense):
    pt = 8
    eng = Engine(weights, num_blocks=48, page_tokens=pt)
    system = _prompt(10, 21)  # shared prefix: 2 full pages + a partial third page
    aligned = _prompt(11, 16)  # page-aligned shared prefix

    a = Req(100, 0, system + _prompt(12, 2), max_new=24)  # prompt ends inside the shared page
    b = Req(101, 1, system + _prompt(13, 9), max_new=30)
    c = Req(102, 2, _prompt(14, 13), max_new=35)  # will be preempted and recomputed
    d = Req(0, 3, system, max_new=12)  # prompt == the prefix exactly
    e = Req(2**64 - 1, 4, aligned + _prompt(15, 5), max_new=18)
    f = Req(104, 5, aligned + _prompt(16, 11), max_new=20)

    eng.admit(a)
    eng.publish("system", a, len(system))
    shared = list(eng.prefixes["system"][0])
    eng.admit(c)
    eng.admit(e)
    eng.publish("aligned", e, len(aligned))

    cow0 = eng.cow
    eng.admit(b, prefix="system")  # suffix prefill writes into the shared partial page -> copy
    assert eng.cow == cow0 + 1
    assert b.pages[:2] == shared[:2] and b.pages[2] != shared[2]
    assert eng.backend.tokens_prefilled == len(a.prompt) + len(c.prompt) + len(e.prompt) + 9

    running = [a, b, c, e]
    rounds = 0
    preempted = False
    while any(not r.done for r in running) or not (d in running and f in running):
        eng.decode_round(running)
        rounds += 1
        if rounds == 1:
            # a's first decode write lands in the page it shares with the store -> copy
            assert a.pages[2] != shared[2] and a.pages[:2] == shared[:2]
        if rounds == 5 and d not in running:
            eng.admit(d, prefix="system")  # whole prompt covered: recompute last token
            running.append(d)
        if rounds == 8 and not preempted:
            eng.preempt_and_recompute(c)
            preempted = True
        for r in running:
            if r.done and r.pages:
                eng.free(r)
        if a.done and f not in running:
            # pages freed by finished requests are handed out again
            eng.unpublish("system")
            eng.admit(f, prefix="aligned")  # aligned prefix: first write allocates, no copy
            assert f.pages[:2] == eng.prefixes["aligned"][0]
            running.append(f)
        assert rounds < 200

    assert preempted and eng.pool.reused > 0 and eng.cow >= 3
    for r in running:
        assert r.generated == dense.generate(r.prompt, r.max_new), r.rid
    eng.unpublish("aligned")
    assert all(n == 0 for n in eng.pool.refs)
    assert eng.backend.pages_copied == eng.cow


def test_recompute_after_preemption_equals_continuing(weights, dense):
    prompt = _prompt(20, 19)
    eng = Engine(weights, num_blocks=12, page_tokens=4)
    r = Req(1, 0, prompt, max_new=25)
    eng.admit(r)
    for _ in range(9):
        eng.decode_round([r])
    old = list(r.pages)
    eng.preempt_and_recompute(r)
    assert set(old) <= set(r.pages)  # the freed pages are handed out again (LIFO)
    while not r.done:
        eng.decode_round([r])
    assert r.generated == dense.generate(prompt, 25)


def test_copy_pages_in_order(weights):
    be = PagedModelBackend(weights, num_pages=4, page_tokens=2)
    be.kv[:] = np.arange(4, dtype=np.float64).reshape(4, 1, 1, 1, 1, 1)
    ops = np.array([(0, 1), (1, 2)], dtype=COPY_OP)
    assert be.copy_pages(ops) == 2 and be.pages_copied == 2
    assert [float(be.kv[i].flat[0]) for i in range(4)] == [0.0, 0.0, 0.0, 3.0]
    be.copy_pages([(3, 0)])
    assert float(be.kv[0].flat[0]) == 3.0 and be.pages_copied == 3
    with pytest.raises(ValueError):
        be.copy_pages(np.array([(0, 4)], dtype=COPY_OP))


def test_execute_ragged_rejects_bad_input_without_writing(weights):
    be = PagedModelBackend(weights, num_pages=4, page_tokens=4)
    kv_before = be.kv.copy()
    outputs = np.zeros(2, dtype=OUTPUT)

    def items_of(*rows):
        return np.array(list(rows), dtype=ITEM)

    table = np.array([0, 1, 9], dtype=np.uint32)
    ok = (1, 0, 5, 0, 0, 1, 0)
    bad = [
        items_of(ok, (2, 1, 5, 4, 0, 1, 0)),  # position 4 needs a 2nd logical page
        items_of(ok, (2, 1, 5, 0, 2, 2, 0)),  # slice past the end of the table
        items_of(ok, (2, 1, 5, 0, 2, 1, 0)),  # page 9 >= num_blocks
        items_of(ok, (2, 1, 512, 0, 1, 1, 0)),  # token id >= vocab
    ]
    for items in bad:
        with pytest.raises(ValueError):
            be.execute_ragged(items, table, outputs)
    with pytest.raises(ValueError):
        be.execute_ragged(items_of(ok, ok), table, np.zeros(1, dtype=OUTPUT))
    assert np.array_equal(be.kv, kv_before) and be.rounds == 0
    assert tuple(be.execute_ragged(items_of(ok), table, outputs)) == (1, 1)
    assert be.rounds == 1 and int(outputs["request_id"][0]) == 1
