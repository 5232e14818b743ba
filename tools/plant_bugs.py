#!/usr/bin/env python3
"""Plant small plausible bugs in the compiled core and the twin, one at a time, and report which
ones the tests catch.

Each mutation is an exact edit (file, old text, new text) of a core ``.pxi`` source or a twin
``.py`` source; its old text must occur exactly once (tests/tools/test_plant_bugs.py checks that
every mutation still applies to the current sources).  For each mutation the script, in a scratch
copy of the tree (one copy for the whole run, in a temporary folder):

1. applies the edit;
2. rebuilds the extension in place (``python setup.py build_ext --inplace``, with
   ``QUALIA_OPT=-O0`` to build faster; twin mutations reuse the unmutated build);
3. runs the tests of the mutation's area (``pytest -x -q -p no:cacheprovider
   --hypothesis-seed=0 --hypothesis-profile=plant_bugs``, the hypothesis database emptied
   first, so a run is deterministic; the profile, registered in ``tests/conftest.py``, neither
   shrinks nor explains a failing example) with a per-mutation timeout; a failing test, a crash
   or a hang counts as caught;
4. restores the file (and the unmutated build).

It prints one line per mutation (name, area, caught / survived / build failed, and the test that
caught it) and a score.  Usage, from the repository root with the test dependencies installed:

    python tools/plant_bugs.py                 # every mutation (about 30 s to 2 min each)
    python tools/plant_bugs.py --list          # the mutations and their areas
    python tools/plant_bugs.py --only NAME     # one mutation (repeatable)
    python tools/plant_bugs.py --only NAME --tests test_x.py   # against one test file

Score (``python tools/plant_bugs.py``, 2 shared cores; a core mutation about 15 s to build and
test, a hang 180 s): every mutation caught, by a failing test for all but one:
``preempting_step_admits`` makes its area's tests run past the limit (caught as a hang; the step
loops in tests/core/test_step.py are bounded, so the hang is inside a call).  The stop ids are
caught by tests/core/test_step.py's stop conditions, core and twin.  A plan one token over the
budget (``chunk_one_over_budget``, ``budget_one_too_high``) fails the step through the plan
buffers' capacity guard (tests/core/test_step.py); ``step_counts_copy_as_allocation`` fails
tests/forks/test_n_groups.py's page counters; ``caching_unknown_tokens`` and the beam ties
fail tests/core/test_cache_known_tokens.py and tests/forks/test_beam_ties.py.

``--jobs N`` runs N mutations at a time, each in its own scratch copy (default 1: one build at a
time).  ``--keep`` leaves the scratch copies.  The exit status is 1 when a mutation survived.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    path: str       # relative to the repository root
    old: str
    new: str
    what: str

    @property
    def compiled(self) -> bool:
        return self.path.endswith((".pxi", ".pyx", ".pxd", ".c", ".h"))


# The tests each area runs, fastest and most direct first (-x stops at the first failure): file
# names, found anywhere under tests/.
AREAS: Dict[str, Tuple[str, ...]] = {
    "pool": ("test_pool.py", "test_table.py", "test_seed_vs_twin.py"),
    "table": ("test_table.py", "test_fork_pages.py", "test_seed_vs_twin.py"),
    "facade": ("test_request_scheduler.py", "test_facade.py", "test_fork_pages.py",
               "test_seed_vs_twin.py"),
    "cache": ("test_cache.py", "test_cache_known_tokens.py", "test_prefix.py",
              "test_cache_vs_twin.py", "test_whole_pages_vs_twin.py"),
    "step": ("test_step.py", "test_twin_step_vs_dense.py", "test_step_vs_twin.py"),
    "copies": ("test_copies_owed.py", "test_n_groups.py", "test_forks_vs_twin.py",
               "test_step_vs_twin.py"),
    "plan": ("test_step.py", "test_step_runner.py", "test_step_vs_twin.py",
             "test_whole_pages_vs_twin.py"),
    "stop": ("test_step.py", "test_step_vs_twin.py"),
    "beam": ("test_beam_ties.py", "test_beam_search.py", "test_twin_forks_vs_dense.py",
             "test_forks_vs_twin.py"),
    "abi": ("test_step_edge_cases.py", "test_step_backend_abi.py"),
}

C = "qualia/core/"
T = "qualia/twin/"

MUTATIONS: Tuple[Mutation, ...] = (
    # -- pool and tables -------------------------------------------------------------------------
    Mutation(
        "retain_overflow_unchecked", "pool", C + "pages/pool.pxi",
        "    if p.refcount[page] == U32_MAX:\n        return Q_OVERFLOW\n    p.refcount[page] += 1",
        "    p.refcount[page] += 1",
        "retain wraps a count of 2**32-1 to 0"),
    Mutation(
        "release_frees_shared_page", "pool", C + "pages/pool.pxi",
        "    if p.refcount[page] == 0:\n        p.free_stack[p.free_top] = page",
        "    if p.refcount[page] <= 1:\n        p.free_stack[p.free_top] = page",
        "a release that leaves one holder pushes the page on the free stack"),
    Mutation(
        "cow_missing_release", "table", C + "pages/table.pxi",
        "    pool_release(p, page)  # shared (count >= 2): never frees, never fails\n",
        "",
        "copy-on-write keeps its reference on the shared source page (a refcount leak)"),
    Mutation(
        "cow_skipped_at_refcount_2", "table", C + "pages/table.pxi",
        "    if p.refcount[page] == 1:\n        out.kind = COW_EXCLUSIVE",
        "    if p.refcount[page] <= 2:\n        out.kind = COW_EXCLUSIVE",
        "a page shared by two holders is written in place"),
    Mutation(
        "attach_undo_leaks_first_page", "table", C + "pages/table.pxi",
        "            for j in range(i):\n                pool_release(p, pages[j])",
        "            for j in range(1, i):\n                pool_release(p, pages[j])",
        "a failed attach keeps its retain on the first page"),
    Mutation(
        "reserve_undo_missing_retain", "facade", C + "seed/reserve.pxi",
        "            pool_retain(p, log[k].src)\n",
        "",
        "undoing a copy-on-write forgets to take the source page back"),
    Mutation(
        "reserve_counts_copy_as_allocation", "facade", C + "seed/facade.pxi",
        "                self.pages_copied += n_copies\n"
        "                self.pages_allocated += n_undo - n_copies\n",
        "                self.pages_copied += n_copies\n"
        "                self.pages_allocated += n_undo\n",
        "reserve() counts a copy-on-write copy in stats()['pages_allocated']"),
    # -- automatic prefix cache ------------------------------------------------------------------
    Mutation(
        "cache_hit_without_token_check", "cache", C + "cache/pagecache.pxi",
        "    return pc_same_tokens(pc_tok(c, q), t, c.page_tokens)",
        "    return True",
        "a cached entry with the right identity matches whatever its tokens"),
    Mutation(
        "caching_unknown_tokens", "cache", C + "cache/autoprefix.pxi",
        "    limit = (sl.token_count if sl.token_count < st.known else st.known)\n",
        "    limit = sl.token_count\n",
        "pages are cached once computed, even where their tokens are not known yet"),
    Mutation(
        "reclaim_event_missing", "cache", C + "cache/pagecache.pxi",
        "    pc_emit(c, KV_REMOVED, x.ident, x.parent_ident, x.has_parent, ns, c.page_tokens, "
        "page)\n",
        "",
        "a reclaimed page emits no 'removed' KV event"),
    Mutation(
        "reclaim_most_recent_first", "cache", C + "cache/pagecache.pxi",
        "    k = _pc_slot(c, c.ring_len)\n    c.order[k] = p\n",
        "    c.ring_head = c.ring_head - 1 if c.ring_head else c.ring_cap - 1\n"
        "    k = c.ring_head\n    c.order[k] = p\n",
        "a page that becomes reclaimable goes to the head of the list: reclaim takes the most "
        "recently used page"),
    Mutation(
        "index_removal_moves_entry_off_home", "cache", C + "cache/pagecache.pxi",
        "        move = ((k - i - 1) & mask) >= ((j - i) & mask)\n",
        "        move = ((k - i - 1) & mask) >= ((j - i - 1) & mask)\n",
        "a removal from the prefix index moves an entry sitting at its home back, before it"),
    Mutation(
        "unlink_leaves_ring_entry_live", "cache", C + "cache/pagecache.pxi",
        "        c.alive[r.pos] = 0         # its ring entry is dead\n",
        "",
        "a page taken off the middle of the reclaimable list keeps its live entry in the ring"),
    Mutation(
        "head_passes_one_past_the_dead_slots", "cache", C + "cache/pagecache.pxi",
        "            c.ring_head = _pc_slot(c, c.cmp_r)\n",
        "            c.ring_head = _pc_slot(c, c.cmp_r + 1)\n",
        "a head passing the dead slots of a compaction in progress passes one entry more"),
    Mutation(
        "ring_compaction_keeps_old_slots", "cache", C + "cache/pagecache.pxi",
        "                c.alive[w] = 1\n                pc_rec(c, page).pos = w\n",
        "                c.alive[w] = 1\n",
        "compacting the ring moves its live entries but leaves their pages' slots where they were"),
    Mutation(
        "compaction_offsets_ignore_the_head", "cache", C + "cache/pagecache.pxi",
        "    if c.cmp_r:\n        c.cmp_r -= 1\n        if c.cmp_w:\n            c.cmp_w -= 1\n",
        "",
        "the ring's head moves on during a compaction, but the compaction's offsets from it stay"),
    Mutation(
        "compaction_end_keeps_dead_slots", "cache", C + "cache/pagecache.pxi",
        "    if c.cmp_r == c.ring_len:\n        c.ring_len = c.cmp_w\n",
        "    if c.cmp_r == c.ring_len:\n",
        "a compaction that has read every entry leaves the dead slots after the compacted ones "
        "in the ring"),
    Mutation(
        "head_passes_compacted_entries", "cache", C + "cache/pagecache.pxi",
        "        if c.cmp_w == 0 and c.cmp_r:\n",
        "        if c.cmp_r:\n",
        "a head that meets a compaction in progress passes the compacted entries with the dead "
        "ones"),
    Mutation(
        "dead_run_passes_a_live_word", "cache", C + "cache/pagecache.pxi",
        "        if w[0] | w[1] | w[2] | w[3]:\n",
        "        if w[0] | w[1] | w[2]:\n",
        "the head's pass over a run of dead entries misses a live entry in the last 8 of 32 "
        "liveness bytes read at once"),
    Mutation(
        "dead_run_leaves_compaction_offsets", "cache", C + "cache/pagecache.pxi",
        "        if c.cmp_r:\n            c.cmp_r -= d if d < c.cmp_r else c.cmp_r\n"
        "            c.cmp_w -= d if d < c.cmp_w else c.cmp_w\n",
        "",
        "the head passes a run of dead entries during a compaction, but the compaction's "
        "offsets from it stay"),
    Mutation(
        "reclaim_keeps_namespace_count", "cache", C + "cache/pagecache.pxi",
        "    lk.ns_next = U32_MAX\n    t.n_rec[ns] -= 1\n",
        "    lk.ns_next = U32_MAX\n",
        "a reclaimed page stays counted among its namespace's reclaimable pages"),
    Mutation(
        "fill_under_a_dropped_parent", "cache", C + "cache/autoprefix.pxi",
        "        if k == first and k and not pc_live(c, pp, pg):\n",
        "        if False:\n",
        "a page is cached under a parent entry that was reclaimed or cleared since it filled"),
    Mutation(
        "page_copy_short_at_16", "cache", C + "cache/pagecache.pxi",
        "        memcpy(dst, src, 16 * sizeof(uint32_t))\n",
        "        memcpy(dst, src, 15 * sizeof(uint32_t))\n",
        "a cached page of 16 tokens keeps 15 of them for the hits to verify against"),
    Mutation(
        "finish_run_reclaimable_uncounted", "cache", C + "cache/pagecache.pxi",
        "    c.n_state[PC_RECLAIMABLE] += r.moved\n",
        "",
        "a finish relinks its pages as reclaimable but leaves them out of the reclaimable count"),
    Mutation(
        "appended_pages_undercounted", "cache", C + "cache/autoprefix.pxi",
        "        need[0] += last - first + 1\n",
        "        need[0] += last - first\n",
        "a chunk of new pages reclaims room for one page fewer than it allocates"),
    Mutation(
        "cache_hit_leaves_no_token", "cache", C + "cache/autoprefix.pxi",
        "    cdef uint32_t cap = (n - 1) // pt if n else 0\n    cdef uint64_t prev = 0, pg = 0",
        "    cdef uint32_t cap = n // pt if n else 0\n    cdef uint64_t prev = 0, pg = 0",
        "a prompt of whole cached pages is a full hit, leaving no token to compute"),
    # -- the engine step: scheduling -------------------------------------------------------------
    Mutation(
        "pages_needed_off_by_one", "step", C + "step/schedule.pxi",
        "    need = <uint32_t>((hit + n - 1) // st.lim.page_tokens + 1 - hit // "
        "st.lim.page_tokens)",
        "    need = <uint32_t>((hit + n) // st.lim.page_tokens + 1 - hit // st.lim.page_tokens)",
        "admission counts one page too many when the chunk ends on a page boundary"),
    Mutation(
        "wrong_preemption_victim", "step", C + "step/running.pxi",
        "                    and st.ent[e].ord.admitted > st.ent[best].ord.admitted)):\n"
        "            best = e\n    return best",
        "                    and st.ent[e].ord.admitted < st.ent[best].ord.admitted)):\n"
        "            best = e\n    return best",
        "preemption picks the least recently admitted among equal priorities"),
    Mutation(
        "chunk_one_over_budget", "step", C + "step/schedule.pxi",
        "    cdef uint32_t n = remaining if remaining < left else left\n",
        "    cdef uint32_t n = remaining if remaining <= left else left + 1\n",
        "a chunk cut by the token budget is one token over it"),
    Mutation(
        "budget_one_too_high", "step", C + "step/schedule.pxi",
        "nd = 0, left = st.lim.budget, n",
        "nd = 0, left = st.lim.budget + 1, n",
        "a step starts with one token more than max_num_batched_tokens"),
    Mutation(
        "preempting_step_admits", "step", C + "step/schedule.pxi",
        "    if not preempted:\n        while st.wait.n",
        "    if True:\n        while st.wait.n",
        "a step that preempted still admits waiting requests"),
    Mutation(
        "waiting_order_reversed_arrival", "step", C + "step/queue.pxi",
        "        return st.ent[a].ord.arrival < st.ent[b].ord.arrival",
        "        return st.ent[a].ord.arrival > st.ent[b].ord.arrival",
        "among equal priorities the latest arrival is admitted first"),
    Mutation(
        "decode_fast_path_at_refcount_2", "copies", C + "step/schedule.pxi",
        "        if page < st.pg.p.num_blocks and st.pg.p.refcount[page] == 1:",
        "        if page < st.pg.p.num_blocks and st.pg.p.refcount[page] <= 2:",
        "a decode writes in place into a page it shares with one other holder"),
    Mutation(
        "step_counts_copy_as_allocation", "copies", C + "step/schedule.pxi",
        "    st.pg.pages_allocated[0] += n_undo - n_copies",
        "    st.pg.pages_allocated[0] += n_undo",
        "the step counts a copy-on-write copy in stats()['pages_allocated']"),
    # -- the engine step: the plan ---------------------------------------------------------------
    Mutation(
        "slot_mapping_wrong_page", "plan", C + "step/plan.pxi",
        "                lp += 1\n                off = 0\n",
        "                off = 0\n",
        "slot_mapping keeps a chunk's first page for every later page"),
    Mutation(
        "logits_index_off_by_one", "plan", C + "step/plan.pxi",
        "                logits[m] = <int32_t>(T - 1)\n                sampled_ids[m] = r.req.rid\n"
        "                m += 1\n            elif",
        "                logits[m] = <int32_t>(T - 2)\n                sampled_ids[m] = r.req.rid\n"
        "                m += 1\n            elif",
        "a sampled row names the token before the chunk's last"),
    Mutation(
        "kv_last_page_len_off_by_one", "plan", C + "step/plan.pxi",
        "<int32_t>(seq - (pages - 1) * pt)",
        "<int32_t>(seq - 1 - (pages - 1) * pt)",
        "kv_last_page_len one short"),
    Mutation(
        "last_prompt_token_counted_as_decode", "plan", C + "step/schedule.pxi",
        "        st.ent[e].at.decode = rem == 1 and st.ent[e].at.num_computed >= "
        "st.ent[e].req.num_prompt",
        "        st.ent[e].at.decode = rem == 1",
        "the prompt's last token, scheduled alone, counts as a decode token"),
    # -- stop conditions -------------------------------------------------------------------------
    Mutation(
        "stop_ids_skipped", "stop", C + "step/update.pxi",
        "    for k in range(r.req.n_stop):\n        if r.names.stop[k] == tok:",
        "    for k in range(1, r.req.n_stop):\n        if r.names.stop[k] == tok:",
        "the first stop id never stops a request"),
    Mutation(
        "ignore_eos_ignored", "stop", C + "step/update.pxi",
        "    if r.req.has_eos and not r.req.ignore_eos and tok == r.req.eos:",
        "    if r.req.has_eos and tok == r.req.eos:",
        "eos stops a request that asked to ignore it"),
    Mutation(
        "length_one_over", "stop", C + "step/update.pxi",
        "    if pos + 1 - r.req.num_prompt >= r.req.max_new:",
        "    if pos + 1 - r.req.num_prompt > r.req.max_new:",
        "a request generates max_new_tokens + 1 tokens"),
    Mutation(
        "prompt_last_token_unset", "plan", C + "step/requests.pxi",
        "    r.at.last_token = tok[n - 1] if n else 0\n",
        "",
        "a prompt lowered as a last chunk of one token reads the entry's previous last token"),
    Mutation(
        "lowered_page_slots_shifted", "plan", C + "step/plan.pxi",
        "        qualia_lower_page16(positions, slot_mapping, pos, sm)\n",
        "        qualia_lower_page16(positions, slot_mapping, pos, sm + 1)\n",
        "a whole page's tokens are lowered into the slots one to the right"),
    Mutation(
        "appended_last_token_stale", "plan", C + "step/arena.pxi",
        "    r.req.num_tokens += 1\n    r.at.last_token = tok\n",
        "    r.req.num_tokens += 1\n",
        "a decode's input is the entry's previous last token, not the token just appended"),
    # -- beam search -----------------------------------------------------------------------------
    Mutation(
        "beam_tie_rank_reversed", "beam", C + "step/beams.pxi",
        "        return rank < x.rank\n",
        "        return rank > x.rank\n",
        "equal scores: the later beam's candidate goes first"),
    Mutation(
        "beam_tie_token_reversed", "beam", C + "step/beams.pxi",
        "    return tok < x.tok\n",
        "    return tok > x.tok\n",
        "equal scores of one beam: the higher token id goes first"),
    Mutation(
        "update_room_misses_parked_beams", "beam", C + "step/scheduler.pxi",
        "        self._accum_room(<uint64_t>self.step.done.n_accum + self.step.lim.max_queued)\n",
        "        self._accum_room(<uint64_t>self.step.done.n_accum + self.step.plan.m "
        "+ self.step.run.n)\n",
        "update makes room for the ids of its sampled rows and running requests only: a parked "
        "beam a selection stops is dropped from the next plan's finished ids once aborts filled "
        "the list"),
    # -- what a backend hands the step, and what it is handed ------------------------------------
    Mutation(
        "token_limit_takes_no_token_id", "abi", C + "step/state.pxi",
        "    return st.lim.vocab - 1 if st.lim.vocab else U32_MAX - 1\n",
        "    return st.lim.vocab - 1 if st.lim.vocab else U32_MAX\n",
        "without a vocab_size, update() and a Python backend's run() take 0xFFFFFFFF, the id "
        "that marks a row no C backend wrote"),
    Mutation(
        "backend_attr_swallows_its_errors", "abi", C + "backends/backends.pxi",
        "    if _declares(backend, name):\n        return getattr(backend, name)",
        "    if False:\n        return getattr(backend, name)",
        "a backend property that raises AttributeError is taken for an absent attribute: "
        "run() falls back to execute_step without a word"),
    Mutation(
        "lowering_takes_any_slot", "abi", C + "backends/backends.pxi",
        "            if p.slot_mapping[t] != want:\n",
        "            if p.slot_mapping[t] != want and p.slot_mapping[t] < 0:\n",
        "a Python plan lowered for a C backend may map a token to another page's slot"),
    Mutation(
        "stop_id_past_the_limit_taken", "abi", C + "step/scheduler.pxi",
        "    for x in stops:\n        if x > limit:\n",
        "    for x in stops:\n        if x > limit + 1:\n",
        "add_request takes a stop id one past the largest id a step can sample (vocab_size, or "
        "0xFFFFFFFF): a stop condition that never holds"),
    # -- the twin (the executable spec) ----------------------------------------------------------
    Mutation(
        "twin_token_limit_takes_no_token_id", "abi", T + "seed.py",
        "    return U32_MAX - 1 if vocab_size is None else vocab_size - 1\n",
        "    return U32_MAX if vocab_size is None else vocab_size - 1\n",
        "twin: without a vocab_size, update() takes 0xFFFFFFFF"),
    Mutation(
        "twin_cow_skipped_at_refcount_2", "table", T + "seed.py",
        "        if count == 1:\n            return CopyOnWrite.exclusive(src)",
        "        if count <= 2:\n            return CopyOnWrite.exclusive(src)",
        "twin: a page shared by two holders is written in place"),
    Mutation(
        "twin_wrong_preemption_victim", "step", T + "step.py",
        "key=lambda q: (q.priority, q.admitted))",
        "key=lambda q: (q.priority, -q.admitted))",
        "twin: preemption picks the least recently admitted among equal priorities"),
    Mutation(
        "twin_chunk_one_over_budget", "step", T + "step.py",
        "            n = min(remaining, left)\n",
        "            n = min(remaining, left + 1)\n",
        "twin: a chunk cut by the token budget is one token over it"),
    Mutation(
        "twin_slot_mapping_wrong_page", "plan", T + "step.py",
        "                slots.append(table[p // pt] * pt + p % pt)",
        "                slots.append(table[start // pt] * pt + p % pt)",
        "twin: slot_mapping keeps the chunk's first page for every later page"),
    Mutation(
        "twin_stop_ids_skipped", "stop", T + "step.py",
        "            tok in self.stop\n",
        "            tok in list(self.stop)[1:]\n",
        "twin: the first stop id never stops a request"),
    Mutation(
        "twin_caching_unknown_tokens", "cache", T + "cache.py",
        "        limit = min(sl.token_count, st.known) // pt",
        "        limit = sl.token_count // pt",
        "twin: pages are cached once computed, even where their tokens are not known yet"),
    Mutation(
        "twin_cache_hit_without_token_check", "cache", T + "cache.py",
        "        return e.tokens == tuple(tokens)",
        "        return True",
        "twin: a cached entry with the right identity matches whatever its tokens"),
    Mutation(
        "twin_beam_tie_rank_reversed", "beam", T + "groups.py",
        "    cands.sort(key=lambda c: (-c[0], c[1], c[2]))",
        "    cands.sort(key=lambda c: (-c[0], -c[1], c[2]))",
        "twin: equal scores, the later beam's candidate goes first"),
    Mutation(
        "twin_beam_tie_token_reversed", "beam", T + "groups.py",
        "    cands.sort(key=lambda c: (-c[0], c[1], c[2]))",
        "    cands.sort(key=lambda c: (-c[0], c[1], -c[2]))",
        "twin: equal scores of one beam, the higher token id goes first"),
)


def area_tests(area: str, root: str = ROOT, names: Optional[Sequence[str]] = None) -> List[str]:
    """The area's test files (or the files `names`), as paths relative to root (ValueError when
    one is missing)."""
    where: Dict[str, List[str]] = {}
    for d, _, files in os.walk(os.path.join(root, "tests")):
        for f in files:
            where.setdefault(f, []).append(os.path.relpath(os.path.join(d, f), root))
    out = []
    for name in names or AREAS[area]:
        found = where.get(name, [])
        if len(found) != 1:
            raise ValueError(f"area {area}: {len(found)} files named {name} under tests/")
        out.append(found[0])
    return out


def check_applies(m: Mutation, root: str = ROOT) -> None:
    """Raise ValueError unless the mutation's old text occurs exactly once in its file."""
    with open(os.path.join(root, m.path), encoding="utf-8") as f:
        text = f.read()
    n = text.count(m.old)
    if n != 1:
        raise ValueError(f"{m.name}: the old text occurs {n} times in {m.path}, not once")
    if m.old == m.new:
        raise ValueError(f"{m.name}: the edit changes nothing")


def _copy_tree(dst: str) -> None:
    ignore = shutil.ignore_patterns(".git", "build", ".hypothesis", ".pytest_cache",
                                    "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache")
    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)


def _env(scratch: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = scratch + os.pathsep + env.get("PYTHONPATH", "")
    env["QUALIA_OPT"] = "-O0"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _build(scratch: str, log: str) -> bool:
    with open(log, "ab") as out:
        rc = subprocess.call([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                             cwd=scratch, env=_env(scratch), stdout=out, stderr=out)
    return rc == 0


def _so_files(scratch: str) -> List[str]:
    d = os.path.join(scratch, "qualia")
    return [os.path.join(d, f) for f in os.listdir(d) if f.startswith("_core.") and
            f.endswith((".so", ".pyd"))]


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)
_CRASH_AT = re.compile(r'File "[^"]*/(tests/[^"]+)", line \d+ in (\w+)')


def _run_tests(scratch: str, area: str, timeout: float,
               names: Optional[Sequence[str]] = None) -> Tuple[str, str]:
    shutil.rmtree(os.path.join(scratch, ".hypothesis"), ignore_errors=True)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "--hypothesis-seed=0", "--hypothesis-profile=plant_bugs", "-rfE",
           *area_tests(area, scratch, names)]
    proc = subprocess.Popen(cmd, cwd=scratch, env=_env(scratch), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "caught", f"hang (over {timeout:.0f} s)"
    text = out.decode("utf-8", "replace")
    if proc.returncode == 0:
        return "survived", ""
    if proc.returncode in (2, 3, 4, 5):    # interrupted, internal error, usage, no tests
        tail = text.strip().splitlines()[-1:] or ["?"]
        return "error", f"pytest exit {proc.returncode}: {tail[0][:80]}"
    m = _FAILED.search(text)
    if m:
        return "caught", m.group(1)
    if proc.returncode < 0 or "Fatal Python error" in text:
        where = _CRASH_AT.findall(text)
        sig = -proc.returncode if proc.returncode < 0 else "fatal error"
        return "caught", f"crash ({sig})" + (f" in {where[-1][0]}::{where[-1][1]}" if where else "")
    tail = text.strip().splitlines()[-1:] or ["?"]
    return "caught", f"exit {proc.returncode}: {tail[0][:80]}"


def run_mutations(muts: Sequence[Mutation], scratch: str, timeout: float, log: str,
                  report, names: Optional[Sequence[str]] = None
                  ) -> List[Tuple[Mutation, str, str, float]]:
    """Each mutation in turn in one scratch copy; report(row) after each."""
    if not _build(scratch, log):
        raise SystemExit(f"the unmutated tree does not build (see {log})")
    pristine = {so: so + ".pristine" for so in _so_files(scratch)}
    for so, keep in pristine.items():
        shutil.copy2(so, keep)
    rows = []
    for m in muts:
        t0 = time.monotonic()
        path = os.path.join(scratch, m.path)
        with open(path, encoding="utf-8") as f:
            original = f.read()
        stamp = os.stat(path)
        check_applies(m, scratch)
        with open(path, "w", encoding="utf-8") as f:
            f.write(original.replace(m.old, m.new, 1))
        try:
            if m.compiled and not _build(scratch, log):
                result, by = "build failed", f"see {log}"
            else:
                result, by = _run_tests(scratch, m.area, timeout, names)
        finally:
            with open(path, "w", encoding="utf-8") as f:
                f.write(original)
            # the restored source keeps its time, so the restored build is not older than it
            os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
            if m.compiled:
                for so, keep in pristine.items():
                    shutil.copy2(keep, so)
        row = (m, result, by, time.monotonic() - t0)
        rows.append(row)
        report(row)
    return rows


def _line(row) -> str:
    m, result, by, dt = row
    return f"{m.name:38} {m.area:7} {result:9} {dt:5.0f}s  {by}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", action="append", metavar="NAME", help="run this mutation only")
    ap.add_argument("--jobs", type=int, default=1, help="mutations at a time (default 1)")
    ap.add_argument("--timeout", type=float, default=180,
                    help="seconds a mutation's tests may run (default 180); over it is a hang")
    ap.add_argument("--tests", action="append", metavar="FILE",
                    help="run this test file (a name under tests/) instead of the area's "
                         "(repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    args = ap.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:38} {m.area:7} {m.path:32} {m.what}")
        return 0
    muts = list(MUTATIONS)
    if args.only:
        names = {m.name for m in MUTATIONS}
        unknown = [n for n in args.only if n not in names]
        if unknown:
            ap.error(f"unknown mutation(s): {', '.join(unknown)} (see --list)")
        muts = [m for m in MUTATIONS if m.name in args.only]
    for m in muts:
        check_applies(m)
    if args.tests:
        try:
            area_tests(muts[0].area, ROOT, args.tests)
        except ValueError as err:
            ap.error(str(err))
    jobs = max(1, min(args.jobs, len(muts)))
    top = tempfile.mkdtemp(prefix="qualia-plant-")
    print(f"{len(muts)} mutation(s), {jobs} at a time, scratch copies in {top}", flush=True)
    print(f"{'mutation':38} {'area':7} {'result':9} {'time':>6}  caught by", flush=True)
    shares = [muts[i::jobs] for i in range(jobs)]
    rows: List[Tuple[Mutation, str, str, float]] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
            futs = []
            for i, share in enumerate(shares):
                scratch = os.path.join(top, f"tree{i}")
                _copy_tree(scratch)
                futs.append(ex.submit(run_mutations, share, scratch, args.timeout,
                                      os.path.join(top, f"build{i}.log"),
                                      lambda row: print(_line(row), flush=True), args.tests))
            for f in futs:
                rows.extend(f.result())
    finally:
        if not args.keep:
            shutil.rmtree(top, ignore_errors=True)
    caught = sum(r[1] == "caught" for r in rows)
    survived = [r[0].name for r in rows if r[1] == "survived"]
    broken = [r[0].name for r in rows if r[1] in ("build failed", "error")]
    print(f"\ncaught {caught} of {len(rows)}" +
          (f"; survived: {', '.join(survived)}" if survived else "") +
          (f"; not run (build or pytest error): {', '.join(broken)}" if broken else ""), flush=True)
    return 1 if survived or broken else 0


if __name__ == "__main__":
    sys.exit(main())
