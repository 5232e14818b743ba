"""The correctness check of a run (``--check``): every request's tokens, recomputed independently.

* With a model backend the tokens are compared with the **dense model**
  (:class:`qualia.model.DenseModel`: the same weights, one contiguous KV array per request, no
  paging, no sharing), greedy or with the same seeded sampler settings
  (:func:`dense_reference`).
* With a decode-only backend (the C ``qualia.HashBackend``, or ``qualia.twin.PyHashBackend``)
  they are compared with the **hash rule** computed in pure Python (:func:`hash_generate`, over
  ``qualia.twin``): the first token is the rule applied to the last prompt token at its position,
  every next one the rule applied to the previous output at the following position.

:func:`verify_end_state` checks what every run must end with, check or not: each request
completed exactly once, and the pool holding nothing but the prefix store's pages.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional, Sequence

__all__ = ["CheckResult", "hash_next_token", "hash_generate", "check_outputs", "dense_reference",
           "verify_end_state", "progress_reporter", "DENSE_MODEL", "HASH_RULE"]

DENSE_MODEL = "dense model"
HASH_RULE = "pure-Python hash rule"


def hash_next_token(request_id: int, position: int, token_id: int, vocab: int = 32000) -> int:
    """The hash decode rule (docs/DESIGN.md) in pure Python: one definition, in qualia.twin."""
    from .twin import PyHashBackend

    return PyHashBackend.next_token(request_id, position, token_id, vocab)


def hash_generate(request_id: int, prompt: Sequence[int], max_new_tokens: int,
                  end_token: Optional[int] = None, vocab: int = 32000) -> List[int]:
    """What the engine must produce with a decode-only hash backend (see the module
    docstring): at most ``max_new_tokens`` tokens, stopping after ``end_token``."""
    prompt = [int(t) for t in prompt]
    if max_new_tokens < 1:
        return []
    position = len(prompt) - 1
    out = [hash_next_token(request_id, position, prompt[-1], vocab)]
    while len(out) < max_new_tokens and (end_token is None or out[-1] != end_token):
        position += 1
        out.append(hash_next_token(request_id, position, out[-1], vocab))
    return out


@dataclass
class CheckResult:
    ok: bool
    checked: int
    mismatched: List[int]
    against: str

    def describe(self) -> str:
        if self.ok:
            return f"all {self.checked} requests match the {self.against}"
        ids = ", ".join(str(r) for r in self.mismatched[:10])
        more = "" if len(self.mismatched) <= 10 else f" (+{len(self.mismatched) - 10} more)"
        return (f"{len(self.mismatched)} of {self.checked} requests DIFFER from the "
                f"{self.against}: {ids}{more}")


def dense_reference(weights, prompt: Sequence[int], max_new_tokens: int, *,
                    end_token: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                    sampling=None, request_id: int = 0) -> List[int]:
    """The tokens the dense model (no paging) generates for ``prompt``: at most
    ``max_new_tokens``, stopping after ``end_token`` or a stop id (included); ``sampling`` (a
    ``qualia.model.SamplingParams``, default greedy) keyed by ``request_id`` and each token's
    position, as the paged step runner keys it.  Whatever the batching, chunking, prefix hits,
    copies or preemptions of a paged run, its tokens must equal these."""
    from .model import DenseModel

    return DenseModel(weights).generate(prompt, max_new_tokens, end_token,
                                        stop_token_ids=stop_token_ids, sampling=sampling,
                                        request_id=request_id)


def check_outputs(requests: Mapping[int, object], outputs: Mapping[int, List[int]], *,
                  weights=None, end_token: Optional[int] = None, vocab: int = 32000,
                  on_checked: Optional[Callable[[int], None]] = None,
                  sampling=None, stop_token_ids: Sequence[int] = ()) -> CheckResult:
    """Compare ``outputs[request_id]`` with the dense model of ``weights`` (when given) or with
    the pure-Python hash rule over ``vocab``.  ``requests`` maps request id -> a request (with
    ``prompt`` and ``max_new_tokens``); the check fails too when a request has no output.
    ``on_checked(request_id)`` is called after each request.

    Dense model only: ``sampling`` is one ``SamplingParams`` for every request, or a callable
    ``request_id -> SamplingParams`` (or None: greedy); ``stop_token_ids`` end a generation like
    ``end_token``."""
    if weights is not None:
        from .model import DenseModel

        dense = DenseModel(weights)
        against = DENSE_MODEL
        stops = tuple(int(t) for t in stop_token_ids)

        def want(rid, req):
            params = sampling(rid) if callable(sampling) else sampling
            return dense.generate(req.prompt, req.max_new_tokens, end_token,
                                  stop_token_ids=stops, sampling=params, request_id=rid)
    else:
        against = HASH_RULE

        def want(rid, req):
            return hash_generate(rid, req.prompt, req.max_new_tokens, end_token, vocab)

    mismatched = []
    for rid in sorted(outputs):
        if want(rid, requests[rid]) != outputs[rid]:
            mismatched.append(rid)
        if on_checked is not None:
            on_checked(rid)
    n = len(outputs)
    return CheckResult(not mismatched and n == len(requests), n, mismatched, against)


def progress_reporter(progress: Callable[[str, int, int], None], total: int
                      ) -> Callable[[int], None]:
    """An ``on_checked`` for :func:`check_outputs` that reports ``progress("check", done,
    total)`` (first, at once, with ``done == 0``)."""
    done = [0]
    progress("check", 0, total)

    def on_checked(request_id: int) -> None:
        done[0] += 1
        progress("check", done[0], total)

    return on_checked


def verify_end_state(scheduler, submitted: Mapping[int, object], completions: Mapping[int, int],
                     pending: int = 0) -> None:
    """Raise ``RuntimeError`` unless every request of ``submitted`` completed exactly once
    (``completions`` maps request id -> times completed), none is ``pending`` or active in
    ``scheduler`` (a ``qualia.Scheduler``), and the pool holds nothing but the prefix store's
    pages, each with the refcount of the entries that hold it, and cached pages that only the
    cache holds."""
    s = scheduler
    problems = []
    done = set(completions)
    if set(submitted) != done:
        missing = sorted(set(submitted) - done)[:10]
        extra = sorted(done - set(submitted))[:10]
        problems.append(f"not completed: {missing}; unknown completed: {extra}")
    dup = sorted(r for r, n in completions.items() if n != 1)
    if dup:
        problems.append(f"completed more than once: {dup[:10]}")
    if pending:
        problems.append(f"{pending} requests still pending")
    if s.active_count != 0:
        problems.append(f"{s.active_count} requests still active in the scheduler")
    st = s.prefixes
    held = collections.Counter(p for ident in st.identities() for p in st.pages_of(ident))
    if s.free_pages + len(held) != s.num_blocks:
        problems.append(
            f"pool leak: {s.free_pages} free + {len(held)} store pages != {s.num_blocks}")
    cache = s.cache_stats()  # automatic caching: every cached page is the cache's alone
    if cache.cached_pages != cache.reclaimable_pages:
        problems.append(f"{cache.cached_pages - cache.reclaimable_pages} cached pages still "
                        f"held by a request")
    for page in s.reclaimable_pages().tolist():
        if s.pool.refcount(page) != 1:
            problems.append(f"cached page {page}: refcount {s.pool.refcount(page)}, expected 1")
            break
    for page, count in held.items():
        if s.pool.refcount(page) != count:
            problems.append(f"page {page}: refcount {s.pool.refcount(page)}, store holds "
                            f"{count}")
            break
    if problems:
        raise RuntimeError("engine end state is wrong: " + "; ".join(problems))
