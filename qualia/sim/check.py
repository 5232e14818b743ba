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
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["CheckResult", "hash_next_token", "hash_generate", "check_outputs", "check_groups",
           "dense_reference", "verify_end_state", "progress_reporter", "DENSE_MODEL",
           "HASH_RULE", "DENSE_BEAM"]

DENSE_MODEL = "dense model"
HASH_RULE = "pure-Python hash rule"
DENSE_BEAM = "dense beam search"


def hash_next_token(request_id: int, position: int, token_id: int, vocab: int = 32000) -> int:
    """The hash decode rule (docs/DESIGN.md) in pure Python: one definition, in qualia.twin."""
    from ..twin import PyHashBackend

    return PyHashBackend.next_token(request_id, position, token_id, vocab)


def hash_generate(request_id: int, prompt: Sequence[int], max_new_tokens: int,
                  eos_token_id: Optional[int] = None, vocab: int = 32000) -> List[int]:
    """What the engine must produce with a decode-only hash backend (see the module
    docstring): at most ``max_new_tokens`` tokens, stopping after ``eos_token_id``."""
    prompt = [int(t) for t in prompt]
    if max_new_tokens < 1:
        return []
    position = len(prompt) - 1
    out = [hash_next_token(request_id, position, prompt[-1], vocab)]
    while len(out) < max_new_tokens and (eos_token_id is None or out[-1] != eos_token_id):
        position += 1
        out.append(hash_next_token(request_id, position, out[-1], vocab))
    return out


@dataclass
class CheckResult:
    """``ok``: every request was checked and matched; ``mismatched``: the request ids that did
    not; ``problems``: what differed, one line per mismatched request (groups: which member or
    hypothesis, and where)."""

    ok: bool
    checked: int
    """Requests checked."""
    mismatched: List[int]
    against: str
    """What the tokens were compared with (the dense model, or the hash rule computed alone)."""
    problems: List[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the summary: every request matched, or how many differ, which, and the first
        difference."""
        if self.ok:
            return f"all {self.checked} requests match the {self.against}"
        ids = ", ".join(str(r) for r in self.mismatched[:10])
        more = "" if len(self.mismatched) <= 10 else f" (+{len(self.mismatched) - 10} more)"
        first = f"; first: {self.problems[0]}" if self.problems else ""
        return (f"{len(self.mismatched)} of {self.checked} requests DIFFER from the "
                f"{self.against}: {ids}{more}{first}")


def dense_reference(weights, prompt: Sequence[int], max_new_tokens: int, *,
                    eos_token_id: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                    sampling=None, request_id: int = 0) -> List[int]:
    """The tokens the dense model (no paging) generates for ``prompt``: at most
    ``max_new_tokens``, stopping after ``eos_token_id`` or a stop id (included); ``sampling`` (a
    ``qualia.model.SamplingParams``, default greedy) keyed by ``request_id`` and each token's
    position, as the paged step runner keys it.  Whatever the batching, chunking, prefix hits,
    copies or preemptions of a paged run, its tokens must equal these."""
    from ..model import DenseModel

    return DenseModel(weights).generate(prompt, max_new_tokens, eos_token_id,
                                        stop_token_ids=stop_token_ids, sampling=sampling,
                                        request_id=request_id)


def check_outputs(requests: Mapping[int, object], outputs: Mapping[int, List[int]], *,
                  weights=None, eos_token_id: Optional[int] = None, vocab: int = 32000,
                  on_checked: Optional[Callable[[int], None]] = None,
                  sampling=None, stop_token_ids: Sequence[int] = ()) -> CheckResult:
    """Compare ``outputs[request_id]`` with the dense model of ``weights`` (when given) or with
    the pure-Python hash rule over ``vocab``.  ``requests`` maps request id -> a request (with
    ``prompt`` and ``max_new_tokens``); the check fails too when a request has no output.
    ``on_checked(request_id)`` is called after each request.

    Dense model only: ``sampling`` is one ``SamplingParams`` for every request, or a callable
    ``request_id -> SamplingParams`` (or None: greedy); ``stop_token_ids`` end a generation like
    ``eos_token_id``."""
    if weights is not None:
        from ..model import DenseModel

        dense = DenseModel(weights)
        against = DENSE_MODEL
        stops = tuple(int(t) for t in stop_token_ids)

        def want(rid, req):
            params = sampling(rid) if callable(sampling) else sampling
            return dense.generate(req.prompt, req.max_new_tokens, eos_token_id,
                                  stop_token_ids=stops, sampling=params, request_id=rid)
    else:
        against = HASH_RULE

        def want(rid, req):
            return hash_generate(rid, req.prompt, req.max_new_tokens, eos_token_id, vocab)

    mismatched = []
    problems = []
    for rid in sorted(outputs):
        ref = want(rid, requests[rid])
        if ref != outputs[rid]:
            mismatched.append(rid)
            problems.append(f"request {rid}: {_first_difference(outputs[rid], ref)}")
        if on_checked is not None:
            on_checked(rid)
    n = len(outputs)
    return CheckResult(not mismatched and n == len(requests), n, mismatched, against, problems)


def _first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    """Where two token lists part: ``token i: got a, want b`` or the lengths."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"token {i}: got {a}, want {b}"
    return f"got {len(got)} tokens, want {len(want)}"


#: scores of the paged beams and of the dense beam search: equal up to this relative error
SCORE_RTOL = 1e-9


def check_groups(requests: Mapping[int, object], groups: Mapping[int, object], *,
                 weights=None, eos_token_id: Optional[int] = None, vocab: int = 32000,
                 on_checked: Optional[Callable[[int], None]] = None, sampling=None,
                 beam_width: Optional[int] = None, n: int = 1) -> CheckResult:
    """Compare each finished group (``groups[request_id]``, a
    :class:`qualia.sim.report.GroupOutput`) with its references.

    * ``n`` groups: the group has ``n`` outputs and ``n`` distinct member ids, the first the
      request's own (members keyed alike would draw alike), and member ``j``'s tokens equal
      the dense model's ``generate`` of the request's prompt with ``sampling`` keyed by
      ``member_ids[j]`` (with ``weights``), or the hash rule run under ``member_ids[j]``.
    * beam groups (``beam_width``; dense model only): the hypotheses, best first, equal
      ``DenseModel.beam_search`` of the same width, prompt, ``max_new_tokens`` and
      ``eos_token_id``: the same token lists in the same order, each score equal to the dense
      one up to a relative error of :data:`SCORE_RTOL`.

    The check fails too when a request has no group."""
    import math

    if beam_width is not None and weights is None:
        raise ValueError("checking beam search needs the model's weights")
    problems: List[str] = []
    mismatched: List[int] = []
    if weights is not None:
        from ..model import DenseModel

        dense = DenseModel(weights)
        against = DENSE_BEAM if beam_width is not None else DENSE_MODEL
    else:
        against = HASH_RULE

    def member_ref(member: int, req) -> List[int]:
        if weights is None:
            return hash_generate(member, req.prompt, req.max_new_tokens, eos_token_id, vocab)
        return dense.generate(req.prompt, req.max_new_tokens, eos_token_id, sampling=sampling,
                              request_id=member)

    def compare(rid: int, g) -> Optional[str]:
        req: Any = requests.get(rid)
        if req is None:
            return f"request {rid}: a group result for a request never submitted"
        if beam_width is not None:
            ref = dense.beam_search(req.prompt, beam_width, req.max_new_tokens, eos_token_id)
            if len(g.outputs) != len(ref):
                return (f"request {rid}: {len(g.outputs)} hypotheses, the {against} has "
                        f"{len(ref)}")
            scores = g.scores or [math.nan] * len(ref)
            for j, (got, score, hyp) in enumerate(zip(g.outputs, scores, ref)):
                if list(got) != list(hyp.tokens):
                    return (f"request {rid} hypothesis {j} (best first): "
                            f"{_first_difference(got, hyp.tokens)}")
                if not math.isclose(score, hyp.logprob, rel_tol=SCORE_RTOL, abs_tol=1e-12):
                    return (f"request {rid} hypothesis {j}: score {score!r}, the {against} "
                            f"gives {hyp.logprob!r}")
            return None
        if len(g.outputs) != n or len(g.member_ids) != n:
            return (f"request {rid}: {len(g.outputs)} outputs and {len(g.member_ids)} member "
                    f"ids, want n={n}")
        ids = [int(m) for m in g.member_ids]
        if ids[0] != rid or len(set(ids)) != n:
            # members keyed alike draw alike: equal ids would let n copies of one sequence pass
            return (f"request {rid}: member ids {ids} are not {n} distinct ids starting with "
                    f"the request's own")
        for j, (member, got) in enumerate(zip(g.member_ids, g.outputs)):
            want = member_ref(member, req)
            if list(got) != want:
                return (f"request {rid} member {j} (id {member}): "
                        f"{_first_difference(got, want)}")
        return None

    for rid in sorted(groups):
        problem = compare(rid, groups[rid])
        if problem is not None:
            mismatched.append(rid)
            problems.append(problem)
        if on_checked is not None:
            on_checked(rid)
    missing = sorted(set(requests) - set(groups))
    if missing:
        problems.append(f"{len(missing)} requests have no group result: {missing[:10]}")
    k = len(groups)
    return CheckResult(not mismatched and not missing, k, mismatched, against, problems)


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
    ``scheduler`` (a ``qualia.StepScheduler`` or ``qualia.Scheduler``), and the pool holds
    nothing but the prefix store's pages, each with the refcount of the entries that hold it,
    and cached pages that only the cache holds."""
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
    st = getattr(s, "prefixes", None)  # the twin facade under the step twin has no store
    held = collections.Counter() if st is None else collections.Counter(
        p for ident in st.identities() for p in st.pages_of(ident))
    num_pages = s.pool.num_blocks
    if s.free_pages + len(held) != num_pages:
        problems.append(
            f"pool leak: {s.free_pages} free + {len(held)} store pages != {num_pages}")
    cache = s.cache_stats()  # automatic caching: every cached page is the cache's alone
    if cache.cached_pages != cache.reclaimable_pages:
        problems.append(f"{cache.cached_pages - cache.reclaimable_pages} cached pages still "
                        f"held by a request")
    reclaimable = s.reclaimable_pages()
    refcounts = getattr(s.pool, "refcounts", None)  # every page's count at once, where read
    if callable(refcounts):
        wrong = next(iter(reclaimable[np.asarray(refcounts())[reclaimable] != 1].tolist()),
                     None)
    else:
        wrong = next((page for page in reclaimable.tolist() if s.pool.refcount(page) != 1),
                     None)
    if wrong is not None:
        problems.append(f"cached page {wrong}: refcount {s.pool.refcount(wrong)}, expected 1")
    for page, count in held.items():
        if s.pool.refcount(page) != count:
            problems.append(f"page {page}: refcount {s.pool.refcount(page)}, store holds "
                            f"{count}")
            break
    if problems:
        raise RuntimeError("engine end state is wrong: " + "; ".join(problems))
