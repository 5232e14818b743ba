"""The numpy model as a step runner: ``PagedModelBackend.execute_step`` runs a
step plan (prefill chunks and decodes in one forward, K/V through ``slot_mapping``, attention
through the page table and ``seq_lens``, copy-on-write copies first) and its tokens equal the dense
reference (no paging) token for token: hand-built plans first, then plans of the step scheduler
(the compiled ``qualia.StepScheduler`` and the twin ``qualia.twin.StepScheduler``) with chunked
prefill, mixed batches, prefix hits, copies and preemptions; greedy and seeded sampling;
log-probabilities and top-k.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from qualia.model import (
    GREEDY,
    DenseModel,
    ModelConfig,
    ModelWeights,
    PagedModelBackend,
    SamplingParams,
    log_softmax,
    sample_tokens,
    sampling_uniforms,
)
from qualia.sim.check import check_outputs, dense_reference
from qualia.twin import COPY_OP

CONFIG = ModelConfig()  # layers=2, heads=4, head_dim=16, vocab=512
SMALL = ModelConfig(layers=2, heads=2, head_dim=8, vocab=64, seed=7)


@pytest.fixture(scope="module")
def weights():
    return ModelWeights.random(CONFIG)


@pytest.fixture(scope="module")
def small():
    return ModelWeights.random(SMALL)


def _prompt(seed, n, vocab=CONFIG.vocab):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# ------------------------------------------------------------------------------------------
# hand-built plans
# ------------------------------------------------------------------------------------------


def make_plan(chunks, block_table, page_tokens, copies=()):
    """A step plan from ``chunks``: (request_id, row, tokens of the sequence, start, n,
    sample) with the pages of each request in ``block_table[row]``."""
    pt = page_tokens
    rids, qsl, seq_lens, rows, ids, pos, slots, li, srid = [], [0], [], [], [], [], [], [], []
    indptr, indices, last = [0], [], []
    for rid, row, toks, start, n, sample in chunks:
        rids.append(rid)
        rows.append(row)
        end = start + n
        seq_lens.append(end)
        for p in range(start, end):
            ids.append(toks[p])
            pos.append(p)
            slots.append(int(block_table[row, p // pt]) * pt + p % pt)
        qsl.append(qsl[-1] + n)
        if sample:
            li.append(qsl[-1] - 1)
            srid.append(rid)
        npages = -(-end // pt)
        indices.extend(block_table[row, :npages].tolist())
        indptr.append(indptr[-1] + npages)
        last.append(end - (npages - 1) * pt)
    return SimpleNamespace(
        request_ids=np.array(rids, np.uint64), query_start_loc=np.array(qsl, np.int32),
        seq_lens=np.array(seq_lens, np.int32), input_ids=np.array(ids, np.uint32),
        positions=np.array(pos, np.int32), slot_mapping=np.array(slots, np.int64),
        logits_indices=np.array(li, np.int32), sampled_request_ids=np.array(srid, np.uint64),
        block_table=block_table, block_table_rows=np.array(rows, np.int32),
        kv_indptr=np.array(indptr, np.int32), kv_indices=np.array(indices, np.int32),
        kv_last_page_len=np.array(last, np.int32),
        copies=np.array(list(copies), dtype=COPY_OP))


def test_one_request_prompt_in_three_chunks_then_decodes(weights):
    pt = 4
    prompt = _prompt(1, 23)
    want = DenseModel(weights).generate(prompt, 12)
    table = np.full((2, 16), -1, np.int32)
    table[1, :9] = [11, 3, 7, 0, 14, 2, 9, 5, 12]  # scattered physical pages, row 1
    be = PagedModelBackend(weights, num_pages=16, page_tokens=pt)
    toks = list(prompt)
    for start, n in ((0, 9), (9, 6), (15, 8)):  # chunks that end inside and on page edges
        plan = make_plan([(5, 1, toks, start, n, start + n == len(toks))], table, pt)
        out = be.execute_step(plan)
        assert len(out) == (1 if start + n == len(toks) else 0)
    assert out.dtype == np.uint32
    toks.append(int(out[0]))
    while len(toks) - len(prompt) < 12:
        plan = make_plan([(5, 1, toks, len(toks) - 1, 1, True)], table, pt)
        toks.append(int(be.execute_step(plan)[0]))
    assert toks[len(prompt):] == want
    assert be.steps == 3 + 11 and be.step_tokens == 23 + 11 and be.tokens_sampled == 12


def test_step_logits_bit_identical_to_dense(weights):
    """A chunk's logits equal the dense model's bit for bit (same numbers, not just argmax)."""
    pt = 8
    prompt = _prompt(2, 40)
    table = np.arange(16, dtype=np.int32)[::-1].reshape(2, 8).copy()
    be = PagedModelBackend(weights, num_pages=16, page_tokens=pt)
    be.step_logits(make_plan([(1, 0, prompt, 0, 17, False)], table, pt))
    logits = be.step_logits(make_plan([(1, 0, prompt, 17, 23, True)], table, pt))
    assert np.array_equal(logits[0], DenseModel(weights).prompt_logits(prompt))


def test_mixed_batch_with_a_copy(weights):
    """One plan: a decode, a prefill chunk reading a shared prefix page whose partial last page
    is copied first (copy-on-write), and a new request; rows in any order of the table."""
    pt = 4
    dense = DenseModel(weights)
    a_prompt = _prompt(3, 10)
    b_prompt = a_prompt[:6] + _prompt(4, 7)  # shares a's first 6 tokens: page 0 + half page 1
    c_prompt = _prompt(5, 5)
    table = np.full((4, 8), -1, np.int32)
    be = PagedModelBackend(weights, num_pages=32, page_tokens=pt)
    a_toks = list(a_prompt)
    table[2, :4] = [20, 21, 22, 23]  # a lives in row 2
    a_toks.append(int(be.execute_step(make_plan([(10, 2, a_toks, 0, 10, True)], table, pt))[0]))
    # b shares page 20 (full) and page 21 (partial: positions 4, 5 valid); it writes position 6
    # into its own copy of 21 (page 30), copied in the same plan
    table[0, :4] = [20, 30, 31, 3]
    table[3, :2] = [8, 9]
    plan = make_plan(
        [(10, 2, a_toks, 10, 1, True),  # a decodes (position 10, page 22)
         (11, 0, b_prompt, 6, 5, False),  # b: a chunk after its 6 shared tokens
         (12, 3, c_prompt, 0, 5, True)],  # c: new, whole prompt
        table, pt, copies=[(21, 30)])
    ids = be.execute_step(plan)
    assert be.pages_copied == 1
    assert ids.tolist() == [dense.generate(a_prompt, 2)[1], dense.generate(c_prompt, 1)[0]]
    plan = make_plan([(11, 0, b_prompt, 11, 2, True)], table, pt)
    assert int(be.execute_step(plan)[0]) == dense.generate(b_prompt, 1)[0]


def test_csr_page_table_equals_block_table(weights):
    pt = 4
    prompt = _prompt(6, 14)
    table = np.full((1, 8), -1, np.int32)
    table[0, :4] = [6, 1, 4, 2]
    plan = make_plan([(1, 0, prompt, 0, 14, True)], table, pt)
    a = PagedModelBackend(weights, 8, pt).step_logits(plan)
    b = PagedModelBackend(weights, 8, pt, page_table="csr").step_logits(plan)
    assert np.array_equal(a, b)


def test_bad_plans_are_refused_without_writing(weights):
    pt = 4
    prompt = _prompt(7, 6)
    table = np.full((1, 4), -1, np.int32)
    table[0, :2] = [1, 2]
    be = PagedModelBackend(weights, num_pages=4, page_tokens=pt)
    good = make_plan([(1, 0, prompt, 0, 6, True)], table, pt)

    def variant(**kw):
        fields = dict(vars(good))
        fields.update(kw)
        return SimpleNamespace(**fields)

    bad_table = table.copy()
    bad_table[0, 1] = 4  # page 4 >= num_blocks
    bads = [
        variant(input_ids=np.array([1, 2, 3, 4, 5, 512], np.uint32)),  # id >= vocab
        variant(slot_mapping=good.slot_mapping + 1),  # disagrees with the block table
        variant(positions=good.positions + 1),  # positions do not end at seq_lens - 1
        variant(query_start_loc=np.array([0, 5], np.int32)),  # does not cover T
        variant(logits_indices=np.array([6], np.int32)),  # row out of range
        variant(block_table=bad_table, slot_mapping=np.array([4, 5, 6, 7, 16, 17])),
        variant(block_table_rows=np.array([1], np.int32)),
        variant(kv_indices=np.array([1, 3], np.int32)),  # CSR disagrees with the table
        variant(kv_last_page_len=np.array([3], np.int32)),
        variant(copies=np.array([(0, 4)], dtype=COPY_OP)),  # copy into a page past the pool
        # two requests whose tables point at the same page write the same slots
        make_plan([(1, 0, prompt, 0, 6, True), (2, 1, prompt, 0, 6, True)],
                  np.array([[1, 2, -1, -1], [1, 3, -1, -1]], np.int32), pt),
    ]
    be.kv[:] = 1.5
    be.kv[3] = 2.5
    before = be.kv.copy()
    for plan in bads:
        with pytest.raises(ValueError):
            be.execute_step(plan)
    plan = variant(copies=np.array([(3, 0)], dtype=COPY_OP), input_ids=np.array([1.0] * 6))
    with pytest.raises(TypeError):
        be.execute_step(plan)  # float token ids: refused before the copy
    assert np.array_equal(be.kv, before) and be.steps == 0 and be.pages_copied == 0
    assert be.execute_step(good).shape == (1,) and be.steps == 1


def test_empty_plan(weights):
    be = PagedModelBackend(weights, num_pages=4, page_tokens=4)
    plan = make_plan([], np.full((1, 2), -1, np.int32), 4)
    assert be.execute_step(plan).shape == (0,)
    ids, lps = be.execute_step(plan, want_logprobs=True)
    assert ids.shape == (0,) and lps.shape == (0,)


# ------------------------------------------------------------------------------------------
# sampling, log-probabilities, top-k
# ------------------------------------------------------------------------------------------


def test_sampling_params_validated():
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(seed=-1),
                dict(seed=2**64), dict(top_k=-1), dict(temperature=True)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert GREEDY.greedy and not SamplingParams(temperature=0.7).greedy


def test_sampler_is_keyed_by_seed_request_and_position():
    u = sampling_uniforms(3, [1, 1, 2, 1], [5, 6, 5, 5])
    assert ((u >= 0) & (u < 1)).all()
    assert u[0] == u[3] and len(set(u[:3].tolist())) == 3
    assert sampling_uniforms(4, [1], [5])[0] != u[0]
    logits = np.random.default_rng(0).standard_normal((4, 50))
    p = SamplingParams(temperature=1.0, seed=3)
    rows = sample_tokens(logits, p, [1, 1, 2, 1], [5, 6, 5, 5])
    # one row at a time gives the same ids (no dependence on the batch)
    one = [int(sample_tokens(logits[i : i + 1], p, [r], [q])[0])
           for i, (r, q) in enumerate(zip([1, 1, 2, 1], [5, 6, 5, 5]))]
    assert rows.tolist() == one
    # the empirical distribution follows softmax(logits / T)
    big = np.tile(logits[:1], (4000, 1))
    ids = sample_tokens(big, SamplingParams(temperature=1.0, seed=9), np.arange(4000),
                        np.zeros(4000))
    freq = np.bincount(ids, minlength=50) / 4000
    probs = np.exp(log_softmax(logits[:1])[0])
    assert np.abs(freq - probs).max() < 0.05
    # top_k keeps only the k most likely ids
    k3 = sample_tokens(big, SamplingParams(temperature=2.0, seed=1, top_k=3), np.arange(4000),
                       np.zeros(4000))
    assert set(k3.tolist()) == set(np.argsort(-logits[0])[:3].tolist())
    assert (sample_tokens(logits, GREEDY, [0] * 4, [0] * 4) == logits.argmax(axis=1)).all()


@pytest.mark.parametrize("temperature", [1e-300, 1e-308, 1e-310, 5e-324])
def test_a_tiny_temperature_draws_among_the_largest_logits(temperature):
    # logits / temperature overflows for every id: the draw is still among the row's maxima
    logits = np.array([[1.0, 3.0, 2.0, -1.0], [5.0, 0.0, 5.0, 1.0]])
    n = 64
    ids = sample_tokens(np.repeat(logits, n, axis=0), SamplingParams(temperature, seed=5),
                        np.arange(2 * n), np.zeros(2 * n))
    assert set(ids[:n].tolist()) == {1} and set(ids[n:].tolist()) == {0, 2}


def test_logprobs_and_topk(weights):
    pt = 4
    prompt = _prompt(8, 9)
    table = np.arange(4, dtype=np.int32).reshape(1, 4)
    plan = make_plan([(1, 0, prompt, 0, 9, True)], table, pt)
    ids, lps = PagedModelBackend(weights, 4, pt).execute_step(plan, want_logprobs=True)
    top_ids, top_lps = PagedModelBackend(weights, 4, pt).topk(plan, 5)
    logits = DenseModel(weights).prompt_logits(prompt)
    ref = log_softmax(logits[None])[0]
    assert ids.tolist() == [int(np.argmax(logits))] and lps[0] == ref[ids[0]]
    assert top_ids.shape == (1, 5) and top_ids.dtype == np.uint32
    assert top_ids[0].tolist() == np.argsort(-ref, kind="stable")[:5].tolist()
    assert np.array_equal(top_lps[0], ref[top_ids[0]]) and (np.diff(top_lps[0]) <= 0).all()
    assert top_ids[0, 0] == ids[0] and abs(np.exp(ref).sum() - 1) < 1e-12
    with pytest.raises(ValueError):
        PagedModelBackend(weights, 4, pt).topk(plan, 0)


def test_dense_generate_with_logprobs_and_stop_ids(weights):
    dense = DenseModel(weights)
    prompt = _prompt(9, 8)
    out, lps = dense.generate_with_logprobs(prompt, 10)
    assert out == dense.generate(prompt, 10) and len(lps) == 10 and all(x < 0 for x in lps)
    stop = out[4]
    assert dense.generate(prompt, 10, stop_token_ids=[stop]) == out[: out.index(stop) + 1]
    assert dense_reference(weights, prompt, 10, stop_token_ids=[stop]) == \
        out[: out.index(stop) + 1]


# ------------------------------------------------------------------------------------------
# plans of the pure-Python step scheduler
# ------------------------------------------------------------------------------------------


def _drive(w, sched, backend, prompts, max_new, *, sampling=None, eos=None, stop_ids=(),
           arrive_every=1):
    """Add requests one by one between steps and run until idle; returns (outputs, stats)."""
    outputs, stats = {}, dict(steps=0, mixed=0, chunked=set(), preempted=0, cached=0, copies=0)
    pending = list(prompts.items())
    seen_rows = {}
    while pending or sched.has_unfinished():
        for _ in range(arrive_every):
            if pending:
                rid, prompt = pending.pop(0)
                sched.add_request(rid, np.array(prompt, np.uint32), max_new_tokens=max_new[rid],
                                  eos_token_id=eos, stop_token_ids=stop_ids)
                if sampling is not None:
                    backend.set_sampling(rid, sampling(rid))
        plan = sched.schedule()
        stats["steps"] += 1
        stats["mixed"] += plan.num_prefill_tokens > 0 and plan.num_decode_tokens > 0
        stats["preempted"] += len(plan.preempted_request_ids)
        stats["cached"] += plan.num_cached_tokens
        stats["copies"] += len(plan.copies)
        sampled = set(plan.sampled_request_ids.tolist())
        for rid, start, end in zip(plan.request_ids.tolist(), plan.query_start_loc[:-1].tolist(),
                                   plan.query_start_loc[1:].tolist()):
            if rid not in sampled and end - start > 1:
                stats["chunked"].add(rid)
            seen_rows[rid] = True
        for f in sched.update(backend.execute_step(plan)):
            outputs[f.request_id] = f.output_tokens.tolist()
        assert stats["steps"] < 5000
    return outputs, stats


def _scenario(seed, vocab):
    """Prompts with shared prefixes (page-aligned and not), duplicates (whole-prompt hits) and
    assorted lengths."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, 16).tolist()  # 4 full pages of 4
    prompts, max_new = {}, {}
    rid = 100
    for i in range(14):
        kind = i % 4
        if kind == 0:
            p = rng.integers(0, vocab, int(rng.integers(3, 30))).tolist()
        elif kind == 1:
            p = system + rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
        elif kind == 2:
            p = list(system)
        else:
            p = system[:10] + rng.integers(0, vocab, int(rng.integers(2, 9))).tolist()
        prompts[rid] = p
        max_new[rid] = int(rng.integers(1, 14))
        rid += 1 + int(rng.integers(0, 3))
    return prompts, max_new


@pytest.fixture(params=["core", "twin"])
def StepScheduler(request):
    """The scheduler whose plans the model runs: the compiled core and the twin."""
    import qualia
    from qualia.twin import StepScheduler as Twin
    return qualia.StepScheduler if request.param == "core" else Twin


@pytest.mark.parametrize("seed, budget, chunk, blocks", [
    (0, 16, 5, 40), (1, 24, None, 28), (2, 9, 3, 30), (3, 64, 16, 24)])
def test_step_plans_match_dense_reference(small, StepScheduler, seed, budget, chunk, blocks):
    pt = 4
    sched = StepScheduler(blocks, pt, 16, 6, max_num_batched_tokens=budget, max_prefill_chunk=chunk,
                          vocab_size=SMALL.vocab, max_queued=32)
    # odd seeds read the pages through the CSR form (kv_indptr / kv_indices)
    backend = PagedModelBackend(small, blocks, pt, page_table="csr" if seed % 2 else
                                "block_table")
    prompts, max_new = _scenario(seed, SMALL.vocab)
    outputs, stats = _drive(small, sched, backend, prompts, max_new, arrive_every=2)
    assert set(outputs) == set(prompts)
    dense = DenseModel(small)
    for rid, prompt in prompts.items():
        assert outputs[rid] == dense.generate(prompt, max_new[rid]), rid
    # the features this test is about were in play
    assert stats["mixed"] > 0 and stats["chunked"] and stats["cached"] > 0



def test_step_plans_exercise_preemption_and_copies(small, StepScheduler):
    """A small pool: requests are preempted (their full pages stay cached) and recomputed.
    (Automatic caching shares full pages only, so these plans carry no copies: the hand-built
    mixed-batch test covers copies.)"""
    pt = 4
    totals = dict(preempted=0, cached=0)
    dense = DenseModel(small)
    for seed, blocks in ((10, 14), (11, 16), (12, 12)):
        sched = StepScheduler(blocks, pt, 16, 8, max_num_batched_tokens=20, max_prefill_chunk=8,
                              vocab_size=SMALL.vocab)
        backend = PagedModelBackend(small, blocks, pt)
        prompts, max_new = _scenario(seed, SMALL.vocab)
        max_new = {r: 6 + n for r, n in max_new.items()}
        outputs, stats = _drive(small, sched, backend, prompts, max_new, arrive_every=4)
        for rid, prompt in prompts.items():
            assert outputs[rid] == dense.generate(prompt, max_new[rid]), rid
        totals["preempted"] += stats["preempted"]
        totals["cached"] += stats["cached"]
    assert totals["preempted"] > 0 and totals["cached"] > 0


def test_step_plans_seeded_sampling_and_stops(small, StepScheduler):
    """Seeded sampling per request, eos and stop ids: the same tokens as the dense reference,
    whatever the budget (batching and chunking do not change a request's tokens)."""
    pt = 4
    prompts, max_new = _scenario(20, SMALL.vocab)
    max_new = {r: 10 + n for r, n in max_new.items()}

    def params(rid):
        return SamplingParams(temperature=0.8 + 0.1 * (rid % 3), seed=42, top_k=rid % 2 * 20)

    results = []
    for budget, chunk in ((7, 3), (48, None)):
        sched = StepScheduler(40, pt, 16, 6, max_num_batched_tokens=budget, max_prefill_chunk=chunk,
                              vocab_size=SMALL.vocab, max_queued=32)
        backend = PagedModelBackend(small, 40, pt)
        outputs, _ = _drive(small, sched, backend, prompts, max_new, sampling=params, eos=5,
                            stop_ids=(9, 11), arrive_every=3)
        results.append(outputs)
        requests = {r: SimpleNamespace(prompt=p, max_new_tokens=max_new[r])
                    for r, p in prompts.items()}
        res = check_outputs(requests, outputs, weights=small, eos_token_id=5, sampling=params,
                            stop_token_ids=(9, 11))
        assert res.ok, res.describe()
    assert results[0] == results[1]
    greedy = {r: DenseModel(small).generate(p, max_new[r], 5, stop_token_ids=(9, 11))
              for r, p in prompts.items()}
    assert greedy != results[0]  # sampling did change the tokens
    assert any(o[-1] in (5, 9, 11) and len(o) < max_new[r] for r, o in results[0].items())


def test_decode_round_and_step_agree(small, StepScheduler):
    """The v1 round path (prefill + execute_ragged) and the step path give the same tokens."""
    prompt = _prompt(30, 13, SMALL.vocab)
    sched = StepScheduler(8, 4, 8, 2, max_num_batched_tokens=5, vocab_size=SMALL.vocab)
    backend = PagedModelBackend(small, 8, 4)
    outputs, _ = _drive(small, sched, backend, {1: prompt}, {1: 9})
    paged = PagedModelBackend(small, 8, 4)
    pages = np.array([3, 1, 6, 0, 2, 5], np.uint32)
    toks = [paged.prefill(prompt, 0, pages)]
    while len(toks) < 9:
        toks.append(paged.decode_one(toks[-1], len(prompt) + len(toks) - 1, pages))
    assert outputs[1] == toks == dense_reference(small, prompt, 9)


def test_dense_beam_search(small):
    dense = DenseModel(small)
    prompt = _prompt(40, 9, SMALL.vocab)
    one = dense.beam_search(prompt, 1, 8)
    assert len(one) == 1 and one[0].tokens == dense.generate(prompt, 8)
    _, lps = dense.generate_with_logprobs(prompt, 8)
    assert abs(one[0].logprob - sum(lps)) < 1e-9
    beams = dense.beam_search(prompt, 4, 8)
    assert len(beams) == 4 and all(len(b.tokens) == 8 for b in beams)
    assert [b.logprob for b in beams] == sorted((b.logprob for b in beams), reverse=True)
    assert beams[0].logprob >= one[0].logprob  # a wider beam finds at least the greedy score
    # each hypothesis' score is its tokens' log-probability under the model
    for b in beams:
        seq, total = dense.sequence(), 0.0
        logits = seq.feed_logits(prompt)
        for t in b.tokens:
            total += float(log_softmax(logits[None])[0, t])
            logits = seq.feed_logits([t])
        assert abs(total - b.logprob) < 1e-9
    stop = beams[0].tokens[2]
    stopped = dense.beam_search(prompt, 4, 8, stop_token_ids=[stop])
    assert any(b.tokens[-1] == stop and len(b.tokens) < 8 for b in stopped)
    with pytest.raises(ValueError):
        dense.beam_search(prompt, 0, 8)


@pytest.mark.parametrize("budget", [1 << 19, 700])
def test_row_logits_do_not_depend_on_the_batch(weights, monkeypatch, budget):
    """Every sampled row of one mixed plan equals the dense model's logits for that request
    alone, bit for bit, however the rows are split into attention blocks."""
    import qualia.model.weights as model_mod

    monkeypatch.setattr(model_mod, "_ATTEND_BUDGET", budget)
    pt = 4
    rng = np.random.default_rng(50)
    lengths = [37, 1, 12, 25, 6]
    table = np.full((5, 16), -1, np.int32)
    pages = rng.permutation(64).astype(np.int32)
    be = PagedModelBackend(weights, 64, pt)
    prompts, chunks, used = [], [], 0
    for i, n in enumerate(lengths):
        prompt = _prompt(60 + i, n)
        prompts.append(prompt)
        need = -(-n // pt)
        table[i, :need] = pages[used : used + need]
        used += need
        done = int(rng.integers(0, n))  # tokens already computed (written by earlier steps)
        if done:
            be.step_logits(make_plan([(i, i, prompt, 0, done, False)], table, pt))
        chunks.append((i, i, prompt, done, n - done, True))
    order = [3, 0, 4, 1, 2]
    logits = be.step_logits(make_plan([chunks[i] for i in order], table, pt))
    dense = DenseModel(weights)
    for row, i in enumerate(order):
        assert np.array_equal(logits[row], dense.prompt_logits(prompts[i])), i


def _old_forward_token(w, token, keys_of, scale):
    """The original one-token formulation (numpy reductions per token), kept as a reference:
    ``keys_of(layer, k, v)`` stores this token's K/V and returns K, V of positions 0..p."""
    c = w.config
    d, h, hd = c.d_model, c.heads, c.head_dim

    def matvec(x, m):
        return (x[:, None] * m).sum(axis=0)

    def norm(x, g):
        return x * (g / np.sqrt(np.mean(x * x) + c.norm_eps))

    x = w.embed[token].copy()
    cos, sin = w.rope(len(keys_of.tokens))
    for li, lw in enumerate(w.layers):
        qkv = matvec(norm(x, lw.attn_norm), lw.wqkv)
        q = w._apply_rope(qkv[:d].reshape(h, hd), cos, sin)
        k = w._apply_rope(qkv[d : 2 * d].reshape(h, hd), cos, sin)
        keys, values = keys_of(li, k, qkv[2 * d :].reshape(h, hd))
        s = (keys * q).sum(axis=-1) * scale
        e = np.exp(s - s.max(axis=0))
        a = ((e / e.sum(axis=0))[:, :, None] * values).sum(axis=0).reshape(d)
        x = x + matvec(a, lw.wo)
        up = matvec(norm(x, lw.mlp_norm), lw.w_up)
        x = x + matvec(up / (1.0 + np.exp(-up)), lw.w_down)
    return matvec(norm(x, w.final_norm), w.unembed)


def test_same_numbers_as_the_one_token_formulation(weights):
    prompt = _prompt(70, 21)
    c = CONFIG

    class Keys:
        tokens: list = []
        kv = np.zeros((c.layers, 2, 32, c.heads, c.head_dim))

        def __call__(self, li, k, v):
            p = len(self.tokens)
            self.kv[li, 0, p], self.kv[li, 1, p] = k, v
            return self.kv[li, 0, : p + 1], self.kv[li, 1, : p + 1]

    keys = Keys()
    for t in prompt:
        old = _old_forward_token(weights, t, keys, 1.0 / np.sqrt(c.head_dim))
        keys.tokens.append(t)
    assert np.array_equal(old, DenseModel(weights).prompt_logits(prompt))


def test_children_sample_from_one_prefill_row(small):
    """n > 1: a plan may sample one logits row for several request ids (repeated
    ``logits_indices``, the children in ``sampled_request_ids``); child c's tokens then equal
    the dense run of the prompt with the same sampler keyed by c, whatever the batch."""
    pt = 4
    prompt = _prompt(80, 11, SMALL.vocab)
    params = SamplingParams(temperature=1.0, seed=5)
    children = [201, 202, 203, 204]
    table = np.full((5, 8), -1, np.int32)
    table[0, :3] = [0, 1, 2]
    be = PagedModelBackend(small, 32, pt, sampling=params)
    plan = make_plan([(200, 0, prompt, 0, 11, True)], table, pt)
    plan.logits_indices = np.array([10] * 4, np.int32)
    plan.sampled_request_ids = np.array(children, np.uint64)
    first = be.execute_step(plan).tolist()
    # each child continues on its own copy of the last, partial page (copy-on-write)
    toks = {}
    for r, c in enumerate(children):
        table[r + 1, :5] = [0, 1, 10 + r, 20 + r, 24 + r]
        toks[c] = prompt + [first[r]]
    copies = [(2, 10 + r) for r in range(4)]
    for step in range(6):
        chunks = [(c, r + 1, toks[c], len(toks[c]) - 1, 1, True) for r, c in enumerate(children)]
        ids = be.execute_step(make_plan(chunks, table, pt, copies if step == 0 else ()))
        for c, t in zip(children, ids.tolist()):
            toks[c].append(t)
    dense = DenseModel(small)
    outs = {c: toks[c][len(prompt):] for c in children}
    for c in children:
        assert outs[c] == dense.generate(prompt, 7, sampling=params, request_id=c), c
    assert len({tuple(o) for o in outs.values()}) > 1  # the children differ
    # the same first tokens from the logits directly
    logits = PagedModelBackend(small, 32, pt).step_logits(
        make_plan([(200, 0, prompt, 0, 11, True)], table, pt))
    assert be.sample(np.repeat(logits, 4, axis=0), children, [11] * 4).tolist() == first
