"""The paged-attention backend: the model's K/V in pages addressed by block tables (the step
runner and the decode rounds); see :mod:`qualia.model`."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .._types import RaggedBatchReceipt
from .sampling import GREEDY, SamplingParams, _topk_of, log_softmax, sample_tokens
from .weights import ModelWeights, _as_int, _greedy, _row_blocks, _rows_attend

_U32_MAX = 2**32 - 1

# --------------------------------------------------------------------------------------------
# paged backend
# --------------------------------------------------------------------------------------------


class _PagedKv:
    """K/V accessor of one sequence over the page cache (the ``forward_token`` protocol)."""

    __slots__ = ("cache", "pages", "page_tokens")

    def __init__(self, cache: np.ndarray, pages: np.ndarray, page_tokens: int) -> None:
        self.cache = cache
        self.pages = pages
        self.page_tokens = page_tokens

    def write_read(self, layer: int, position: int, k: np.ndarray, v: np.ndarray):
        pt = self.page_tokens
        page = self.pages[position // pt]
        slot = position % pt
        self.cache[page, layer, 0, slot] = k
        self.cache[page, layer, 1, slot] = v
        used = self.pages[: position // pt + 1]
        t = position + 1
        hd = self.cache.shape[-2:]
        keys = self.cache[used, layer, 0].reshape((-1,) + hd)[:t]
        values = self.cache[used, layer, 1].reshape((-1,) + hd)[:t]
        return keys, values


def _field(arr: np.ndarray, name: str, what: str) -> np.ndarray:
    names = arr.dtype.names or ()
    if name not in names:
        raise TypeError(f"{what} must be a structured array with a {name!r} field")
    return arr[name]


def _plan_optional(plan, name: str) -> Optional[np.ndarray]:
    value = getattr(plan, name, None)
    if value is None:
        return None
    arr = np.asarray(value)
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"plan.{name} must be an integer array, got dtype {arr.dtype}")
    return arr


def _plan_array(plan, name: str) -> np.ndarray:
    arr = _plan_optional(plan, name)
    if arr is None:
        raise TypeError(f"plan has no {name!r}")
    return arr


class PagedModelBackend:
    """The tiny transformer over a paged KV cache, driven by block tables.

    ``kv`` has shape ``[num_pages, layers, 2, page_tokens, heads, head_dim]``; page ids index
    its first axis (the K/V of slot ``s`` is ``kv[s // page_tokens, :, :, s % page_tokens]``).
    The backend owns no allocation policy: callers (the scheduler / engine) decide which pages
    a sequence uses and perform copy-on-write via :meth:`copy_pages` (a step plan carries its
    copies, performed first).

    Two protocols: the v1 decode round (:meth:`execute_ragged`, plus :meth:`prefill`), and the
    engine step (:meth:`execute_step` over a step plan: one forward over the flattened mixed
    batch of prefill chunks and decodes, :meth:`topk` for beam search).

    Sampling in steps: ``sampling`` (default greedy) for every request, or per request through
    :meth:`set_sampling`.

    Counters: ``rounds`` (``execute_ragged`` calls), ``items_executed``, ``tokens_prefilled``,
    ``pages_copied``, ``steps`` (step plans executed), ``step_tokens`` (rows computed in
    steps), ``tokens_sampled``.
    """

    def __init__(self, weights: ModelWeights, num_pages: int, page_tokens: int, *,
                 sampling: SamplingParams = GREEDY, page_table: str = "block_table") -> None:
        num_pages = _as_int(num_pages, "num_pages")
        page_tokens = _as_int(page_tokens, "page_tokens")
        if num_pages < 1 or page_tokens < 1:
            raise ValueError("num_pages and page_tokens must be >= 1")
        if num_pages > _U32_MAX:
            raise OverflowError("num_pages must fit page ids in u32")
        if not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be a SamplingParams")
        if page_table not in ("block_table", "csr"):
            raise ValueError("page_table must be 'block_table' or 'csr'")
        c = weights.config
        self.weights = weights
        self.config = c
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.sampling = sampling
        self.page_table = page_table
        self._request_sampling: Dict[int, SamplingParams] = {}
        self.kv = np.zeros(
            (num_pages, c.layers, 2, page_tokens, c.heads, c.head_dim), dtype=weights.dtype
        )
        self.rounds = 0
        self.items_executed = 0
        self.tokens_prefilled = 0
        self.pages_copied = 0
        self.steps = 0
        self.step_tokens = 0
        self.tokens_sampled = 0

    # -- pages -------------------------------------------------------------------------------

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page of the KV cache (every layer's K and V)."""
        return self.kv[0].nbytes

    def _check_pages(self, pages: np.ndarray, what: str) -> None:
        if len(pages) and int(pages.max()) >= self.num_pages:
            bad = int(pages[np.argmax(pages >= self.num_pages)])
            raise ValueError(f"{what}: page id {bad} out of range (num_pages={self.num_pages})")

    def _copy_ops(self, copies) -> Tuple[np.ndarray, np.ndarray]:
        if isinstance(copies, np.ndarray) and copies.dtype.names:
            src = _field(copies, "src_page", "copies").astype(np.int64).reshape(-1)
            dst = _field(copies, "dst_page", "copies").astype(np.int64).reshape(-1)
        else:
            pairs = [(_as_int(s, "src_page"), _as_int(d, "dst_page")) for s, d in copies]
            src = np.asarray([s for s, _ in pairs], dtype=np.int64)
            dst = np.asarray([d for _, d in pairs], dtype=np.int64)
        for arr, what in ((src, "src_page"), (dst, "dst_page")):
            if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= self.num_pages):
                raise ValueError(f"copy_pages: {what} out of range (num_pages={self.num_pages})")
        return src, dst

    def _do_copies(self, src: np.ndarray, dst: np.ndarray) -> int:
        for s, d in zip(src.tolist(), dst.tolist()):
            if s != d:
                self.kv[d] = self.kv[s]
        self.pages_copied += len(src)
        return len(src)

    def copy_pages(self, copies) -> int:
        """Copy physical pages ``src_page -> dst_page`` in order (a ``COPY_OP`` array, or any
        sequence of ``(src, dst)`` pairs).  Returns the number of pages copied."""
        return self._do_copies(*self._copy_ops(copies))

    def _pages(self, block_table, what: str = "block_table") -> np.ndarray:
        pages = np.asarray(block_table)
        if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "ui"):
            raise TypeError(f"{what} must be a 1-D integer array of page ids")
        if pages.size and int(pages.min()) < 0:
            raise ValueError(f"{what}: negative page id")
        pages = pages.astype(np.int64, copy=False)
        self._check_pages(pages, what)
        return pages

    # -- the batched forward over pages ----------------------------------------------------------

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                 row_of: np.ndarray, slots: np.ndarray,
                 out_rows: Optional[np.ndarray]) -> np.ndarray:
        """One forward over rows ``tokens/positions [T]`` (validated): row ``t`` writes its K/V
        at slot ``slots[t]`` and attends positions ``0..positions[t]`` of the sequence whose
        pages are ``tables[row_of[t]]`` (entries past the needed pages are never read)."""
        pt = self.page_tokens
        c = self.config
        per_key = c.heads * c.head_dim
        page_of, off_of = slots // pt, slots % pt
        scale = self.weights._scale
        kv = self.kv

        def attend(layer, q, k, v):
            kv[page_of, layer, 0, off_of] = k
            kv[page_of, layer, 1, off_of] = v
            k_pages, v_pages = kv[:, layer, 0], kv[:, layer, 1]  # [num_pages, pt, H, D]
            out = np.empty_like(q)
            for a, b, length in _row_blocks(positions, per_key):
                rows = row_of[a:b]
                if rows[0] == rows[-1] and (rows == rows[0]).all():
                    rows = rows[:1]  # one sequence: gather its keys once
                npg = -(-length // pt)
                # whole pages (entries past a row's pages are never read: clamp them to 0)
                pages = np.maximum(tables[rows, :npg], 0)
                shape = (len(rows), npg * pt) + k_pages.shape[2:]
                keys = k_pages[pages].reshape(shape)[:, :length]
                values = v_pages[pages].reshape(shape)[:, :length]
                out[a:b] = _rows_attend(q[a:b], positions[a:b], keys, values, scale)
            return out

        return self.weights.forward_rows(tokens, positions, attend, out_rows)

    def _single_table(self, pages: np.ndarray, positions: np.ndarray):
        """(tables, row_of, slots) of rows of one sequence whose pages are ``pages``."""
        pt = self.page_tokens
        tables = pages[None, :]
        row_of = np.zeros(len(positions), dtype=np.int64)
        slots = pages[positions // pt] * pt + positions % pt
        return tables, row_of, slots

    # -- prefill ------------------------------------------------------------------------------

    def prefill_logits(self, tokens, start_position: int, block_table) -> np.ndarray:
        """Write the K/V of ``tokens`` at positions ``start_position ..`` and return the logits
        after the last one.  ``block_table`` is the sequence's whole logical->physical map
        (positions ``< start_position`` are read from it: e.g. shared prefix pages); it must
        cover position ``start_position + len(tokens) - 1``."""
        toks = self.weights.check_tokens(tokens)
        if not len(toks):
            raise ValueError("prefill needs at least one token")
        start = _as_int(start_position, "start_position")
        if start < 0:
            raise ValueError("start_position must be >= 0")
        pages = self._pages(block_table)
        last = start + len(toks) - 1
        if last // self.page_tokens >= len(pages):
            raise ValueError(
                f"block_table has {len(pages)} pages, position {last} needs "
                f"{last // self.page_tokens + 1}"
            )
        positions = np.arange(start, last + 1, dtype=np.int64)
        tables, row_of, slots = self._single_table(pages, positions)
        logits = self._forward(toks, positions, tables, row_of, slots,
                               np.asarray([len(toks) - 1]))[0]
        self.tokens_prefilled += len(toks)
        return logits

    def prefill(self, tokens, start_position: int, block_table) -> int:
        """:meth:`prefill_logits`, then the greedy next token."""
        return _greedy(self.prefill_logits(tokens, start_position, block_table))

    def decode_one(self, token: int, position: int, block_table) -> int:
        """One token of one sequence (same as a one-item ``execute_ragged``)."""
        return self.prefill([token], position, block_table)

    # -- decode round -------------------------------------------------------------------------

    def execute_ragged(self, items, block_table, outputs):
        """One decode round over a ragged batch (the Python backend protocol).  Reads ``items``
        and ``block_table`` only; writes ``outputs[i] = (request_id, slot, next_token_id)`` for
        every item.  Returns ``(batch_size, backend_launches) = (len(items), 1)``.  All items
        are validated before any K/V is written; the round is one batched forward."""
        items = np.asarray(items)
        if items.ndim != 1:
            raise TypeError("items must be a 1-D structured array")
        n = len(items)
        rid = _field(items, "request_id", "items")
        slot = _field(items, "slot", "items")
        tok = _field(items, "token_id", "items")
        pos = _field(items, "position", "items").astype(np.int64)
        off = _field(items, "block_table_offset", "items").astype(np.int64)
        npg = _field(items, "logical_pages", "items").astype(np.int64)
        for name in ("request_id", "slot", "next_token_id"):
            _field(outputs, name, "outputs")
        if len(outputs) < n:
            raise ValueError(f"outputs holds {len(outputs)} records, the round has {n} items")
        table = np.asarray(block_table)
        if table.ndim != 1:
            raise TypeError("block_table must be 1-D")
        if table.size and table.dtype.kind not in "ui":
            raise TypeError("block_table must hold integer page ids")

        toks = self.weights.check_tokens(tok, "items token_id")
        pt = self.page_tokens
        for i in np.flatnonzero(off + npg > len(table)).tolist()[:1]:
            raise ValueError(f"item {i}: block table slice [{off[i]}, {off[i] + npg[i]}) past "
                             f"its end ({len(table)})")
        for i in np.flatnonzero(pos // pt >= npg).tolist()[:1]:
            raise ValueError(f"item {i}: position {pos[i]} needs page {pos[i] // pt}, "
                             f"only {npg[i]} logical pages")
        width = int(npg.max()) if n else 0
        cols = np.arange(width)
        valid = cols[None, :] < npg[:, None]
        flat = table.astype(np.int64)
        tables = np.where(valid, flat[np.minimum(off[:, None] + cols[None, :],
                                                 max(len(flat) - 1, 0))] if len(flat)
                          else 0, 0)
        bad = valid & ((tables < 0) | (tables >= self.num_pages))
        if bad.any():
            i = int(np.argmax(bad.any(axis=1)))
            page = int(tables[i][bad[i]][0])
            raise ValueError(f"item {i} block table: page id {page} out of range "
                             f"(num_pages={self.num_pages})")

        if n:
            row_of = np.arange(n, dtype=np.int64)
            slots = tables[row_of, pos // pt] * pt + pos % pt
            logits = self._forward(toks, pos, tables, row_of, slots, None)
            outputs["request_id"][:n] = rid
            outputs["slot"][:n] = slot
            outputs["next_token_id"][:n] = np.argmax(logits, axis=-1)
        self.rounds += 1
        self.items_executed += n
        return RaggedBatchReceipt(n, 1)

    __call__ = execute_ragged

    # -- engine step ----------------------------------------------------------------------------

    def set_sampling(self, request_id: int, params: Optional[SamplingParams]) -> None:
        """Sampler of one request in steps (``None``: back to the backend's ``sampling``)."""
        rid = _as_int(request_id, "request_id")
        if params is None:
            self._request_sampling.pop(rid, None)
        elif not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams or None")
        else:
            self._request_sampling[rid] = params

    def sampling_of(self, request_id: int) -> SamplingParams:
        """The sampling parameters of ``request_id``: its own, or the backend's default."""
        return self._request_sampling.get(int(request_id), self.sampling)

    def check_plan(self, plan):
        """Validate a step plan against itself and this backend; returns the arrays the
        forward needs.  ValueError/TypeError on any inconsistency (nothing is written)."""
        pt, nb = self.page_tokens, self.num_pages
        toks = self.weights.check_tokens(_plan_array(plan, "input_ids"), "plan.input_ids")
        positions = _plan_array(plan, "positions").astype(np.int64).reshape(-1)
        slots = _plan_array(plan, "slot_mapping").astype(np.int64).reshape(-1)
        qsl = _plan_array(plan, "query_start_loc").astype(np.int64).reshape(-1)
        seq_lens = _plan_array(plan, "seq_lens").astype(np.int64).reshape(-1)
        li = _plan_array(plan, "logits_indices").astype(np.int64).reshape(-1)
        t = len(toks)
        n = len(seq_lens)
        if len(positions) != t or len(slots) != t:
            raise ValueError("plan: input_ids, positions and slot_mapping differ in length")
        if len(qsl) != n + 1 or (n + 1 and (qsl[0] != 0 or qsl[-1] != t)):
            raise ValueError("plan.query_start_loc must hold n + 1 offsets from 0 to T")
        chunk = np.diff(qsl)
        if (chunk < 1).any():
            raise ValueError("plan: every scheduled request needs at least one token")
        row_req = np.repeat(np.arange(n), chunk)  # request of each token row
        want = seq_lens[row_req] - qsl[row_req + 1] + np.arange(t)
        if not np.array_equal(positions, want) or (positions < 0).any():
            raise ValueError("plan.positions must run up to seq_lens - 1 within each request")
        if len(li) and (li.min() < 0 or li.max() >= t):
            raise ValueError("plan.logits_indices out of range")
        srid = _plan_optional(plan, "sampled_request_ids")
        if srid is not None and len(srid) != len(li):
            raise ValueError("plan.sampled_request_ids and logits_indices differ in length")
        npages = (seq_lens + pt - 1) // pt  # pages covering each request's context
        if self.page_table == "csr":
            indptr = _plan_array(plan, "kv_indptr").astype(np.int64).reshape(-1)
            indices = _plan_array(plan, "kv_indices").astype(np.int64).reshape(-1)
            if len(indptr) != n + 1 or (n and (indptr[0] != 0 or indptr[-1] != len(indices))):
                raise ValueError("plan.kv_indptr must hold n + 1 offsets into kv_indices")
            if not np.array_equal(np.diff(indptr), npages):
                raise ValueError("plan.kv_indptr: page counts do not cover seq_lens")
            width = int(npages.max()) if n else 0
            cols = np.arange(width)
            valid = cols[None, :] < npages[:, None]
            idx = np.minimum(indptr[:-1, None] + cols[None, :], max(len(indices) - 1, 0))
            tables = np.where(valid, indices[idx] if len(indices) else 0, -1)
            row_of = row_req
        else:
            table = _plan_array(plan, "block_table")
            rows = _plan_array(plan, "block_table_rows").astype(np.int64).reshape(-1)
            if table.ndim != 2:
                raise ValueError("plan.block_table must be 2-D")
            if len(rows) != n or (n and (rows.min() < 0 or rows.max() >= table.shape[0])):
                raise ValueError("plan.block_table_rows out of range")
            if n and npages.max() > table.shape[1]:
                raise ValueError("plan: seq_lens need more pages than the block table has")
            tables = table.astype(np.int64)
            row_of = rows[row_req]
            valid = np.arange(table.shape[1])[None, :] < npages[:, None]
            tables_used = tables[rows]
            if ((tables_used < 0) | (tables_used >= nb))[valid].any():
                raise ValueError(f"plan.block_table: page id out of range (num_pages={nb})")
        if self.page_table == "csr" and ((tables < 0) | (tables >= nb))[valid].any():
            raise ValueError(f"plan.kv_indices: page id out of range (num_pages={nb})")
        if t:
            derived = tables[row_of, positions // pt] * pt + positions % pt
            if not np.array_equal(slots, derived):
                bad = int(np.argmax(slots != derived))
                raise ValueError(f"plan.slot_mapping[{bad}] = {int(slots[bad])} disagrees with "
                                 f"the page table (slot {int(derived[bad])})")
            if len(np.unique(slots)) != t:
                raise ValueError("plan.slot_mapping: two tokens write the same K/V slot")
        if self.page_table == "block_table":
            self._check_csr(plan, tables[rows] if n else tables[:0], npages, seq_lens)
        copies = getattr(plan, "copies", None)
        src, dst = self._copy_ops(copies if copies is not None else [])
        return toks, positions, tables, row_of, slots, li, src, dst

    def _check_csr(self, plan, tables_used, npages, seq_lens) -> None:
        """When the plan carries the CSR form, it must agree with the block table."""
        indptr = _plan_optional(plan, "kv_indptr")
        indices = _plan_optional(plan, "kv_indices")
        last = _plan_optional(plan, "kv_last_page_len")
        if indptr is None or indices is None:
            return
        indptr = indptr.astype(np.int64).reshape(-1)
        if len(indptr) != len(npages) + 1 or not np.array_equal(np.diff(indptr), npages):
            raise ValueError("plan.kv_indptr disagrees with seq_lens")
        valid = np.arange(tables_used.shape[1])[None, :] < npages[:, None]
        if not np.array_equal(np.asarray(indices).astype(np.int64).reshape(-1),
                              tables_used[valid]):
            raise ValueError("plan.kv_indices disagrees with the block table")
        if last is not None and len(npages):
            want = seq_lens - (npages - 1) * self.page_tokens
            if not np.array_equal(np.asarray(last).astype(np.int64).reshape(-1), want):
                raise ValueError("plan.kv_last_page_len disagrees with seq_lens")

    def step_logits(self, plan) -> np.ndarray:
        """Run the plan: copy-on-write copies first, then one forward over every scheduled
        token (K/V written at ``slot_mapping``, attention through the page table and
        ``seq_lens``, causal within each chunk).  Returns the logits ``float64 [m, vocab]`` of
        the ``logits_indices`` rows.  The plan is validated before anything is written."""
        toks, positions, tables, row_of, slots, li, src, dst = self.check_plan(plan)
        self._do_copies(src, dst)
        self.steps += 1
        if not len(toks):
            return np.zeros((len(li), self.config.vocab), dtype=np.float64)
        self.step_tokens += len(toks)
        return self._forward(toks, positions, tables, row_of, slots, li)

    def _sample_rows(self, plan, logits: np.ndarray) -> np.ndarray:
        li = np.asarray(plan.logits_indices).astype(np.int64).reshape(-1)
        if not len(li):
            return np.zeros(0, dtype=np.uint32)
        srid = getattr(plan, "sampled_request_ids", None)
        if srid is None:
            rids = np.asarray(plan.request_ids).astype(np.uint64)[
                np.searchsorted(np.asarray(plan.query_start_loc)[1:], li, side="right")]
        else:
            rids = np.asarray(srid).astype(np.uint64).reshape(-1)
        pos = np.asarray(plan.positions).astype(np.int64)[li] + 1  # the sampled token's
        return self.sample(logits, rids, pos)

    def sample(self, logits: np.ndarray, request_ids, positions) -> np.ndarray:
        """Token ids ``uint32 [m]`` for rows of ``logits [m, vocab]``: row ``i`` with the
        sampler of ``request_ids[i]`` (:meth:`set_sampling`, else ``sampling``), keyed by
        ``positions[i]``, the position of the token being sampled.  (E.g. k forked children
        sampling their first tokens from their parent's last prompt logits.)"""
        logits = np.asarray(logits, dtype=np.float64)
        rids = np.asarray(request_ids).astype(np.uint64).reshape(-1)
        pos = np.asarray(positions).astype(np.int64).reshape(-1)
        m = len(rids)
        if logits.ndim != 2 or logits.shape[0] != m or len(pos) != m:
            raise ValueError("logits [m, vocab], request_ids [m] and positions [m] must agree")
        out = np.zeros(m, dtype=np.uint32)
        if not m:
            return out
        groups: Dict[SamplingParams, List[int]] = {}
        if not self._request_sampling:
            groups[self.sampling] = list(range(m))
        else:
            for i, r in enumerate(rids.tolist()):
                groups.setdefault(self.sampling_of(r), []).append(i)
        for p, idx in groups.items():
            ix = np.asarray(idx, dtype=np.int64)
            out[ix] = sample_tokens(logits[ix], p, rids[ix], pos[ix])
        self.tokens_sampled += m
        return out

    def execute_step(self, plan, want_logprobs: bool = False):
        """The Python step-backend protocol: run ``plan`` (see :meth:`step_logits`) and return
        the sampled ids ``uint32 [m]`` of its ``logits_indices`` rows, in that order (greedy,
        or each request's :class:`SamplingParams`).  With ``want_logprobs=True``: ``(ids,
        logprobs)``, ``logprobs float64 [m]`` the model's log-probability of each sampled id
        (temperature 1)."""
        logits = self.step_logits(plan)
        ids = self._sample_rows(plan, logits)
        if not want_logprobs:
            return ids
        lp = log_softmax(logits) if len(ids) else np.zeros((0, 1))
        return ids, (lp[np.arange(len(ids)), ids] if len(ids) else np.zeros(0))

    def topk(self, plan, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """Run ``plan`` (instead of :meth:`execute_step`) and return the ``k`` most likely
        next ids of each sampled row with their log-probabilities: ``(ids uint32 [m, k],
        logprobs float64 [m, k])``, best first, ties -> lower id first (beam search)."""
        k = _as_int(k, "k")
        if not 1 <= k <= self.config.vocab:
            raise ValueError(f"k must be in [1, vocab={self.config.vocab}], got {k}")
        logits = self.step_logits(plan)
        return _topk_of(log_softmax(logits), k)


