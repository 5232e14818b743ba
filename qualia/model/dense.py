"""The dense model: the same forward without paging, the reference the paged backend and
the scheduler are checked against; see :mod:`qualia.model`."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .sampling import GREEDY, SamplingParams, _topk_of, log_softmax, sample_tokens
from .weights import ModelWeights, _as_int, _greedy, _row_blocks, _rows_attend

# --------------------------------------------------------------------------------------------
# the dense model: no paging
# --------------------------------------------------------------------------------------------


class DenseSequence:
    """One sequence with a contiguous KV buffer ``[layers, 2, capacity, heads, head_dim]``."""

    def __init__(self, weights: ModelWeights, capacity: int = 64) -> None:
        c = weights.config
        self.weights = weights
        self.kv = np.zeros((c.layers, 2, max(1, capacity), c.heads, c.head_dim), weights.dtype)
        self.length = 0  # positions with K/V written

    def write_read(self, layer: int, position: int, k: np.ndarray, v: np.ndarray):
        """Write the K/V of ``position`` in ``layer`` and return the keys and values of positions
        ``0 .. position``."""
        self.kv[layer, 0, position] = k
        self.kv[layer, 1, position] = v
        t = position + 1
        return self.kv[layer, 0, :t], self.kv[layer, 1, :t]

    def _reserve(self, n: int) -> None:
        cap = self.kv.shape[2]
        if n > cap:
            new_cap = max(n, 2 * cap)
            grown = np.zeros(self.kv.shape[:2] + (new_cap,) + self.kv.shape[3:], self.kv.dtype)
            grown[:, :, :cap] = self.kv
            self.kv = grown

    def feed_logits(self, tokens) -> np.ndarray:
        """Append tokens (one forward over all of them, causal) and return the logits after
        the last."""
        toks = self.weights.check_tokens(tokens)
        if not len(toks):
            raise ValueError("feed needs at least one token")
        start = self.length
        self._reserve(start + len(toks))
        positions = np.arange(start, start + len(toks), dtype=np.int64)
        per_key = self.weights.config.heads * self.weights.config.head_dim
        scale = self.weights._scale

        def attend(layer, q, k, v):
            self.kv[layer, 0, positions] = k
            self.kv[layer, 1, positions] = v
            out = np.empty_like(q)
            for a, b, length in _row_blocks(positions, per_key):
                out[a:b] = _rows_attend(q[a:b], positions[a:b], self.kv[layer, 0, None, :length],
                                        self.kv[layer, 1, None, :length], scale)
            return out

        logits = self.weights.forward_rows(toks, positions, attend, np.asarray([len(toks) - 1]))
        self.length += len(toks)
        return logits[0]

    def fork(self) -> "DenseSequence":
        """An independent copy (its own KV buffer) of this sequence."""
        twin = DenseSequence.__new__(DenseSequence)
        twin.weights, twin.kv, twin.length = self.weights, self.kv.copy(), self.length
        return twin

    def start(self, prompt) -> int:
        """Prefill ``prompt`` into an empty sequence; return the first generated token."""
        if self.length:
            raise ValueError("start() needs an empty sequence")
        return _greedy(self.feed_logits(prompt))

    def step(self, token: int) -> int:
        """Feed one token (normally the previous output); return the next."""
        return _greedy(self.feed_logits([token]))


class BeamHypothesis(NamedTuple):
    """A finished beam: its output tokens and their cumulative model log-probability."""

    tokens: List[int]
    """The output tokens."""
    logprob: float
    """Their cumulative log-probability under the model."""


class DenseModel:
    """The same model without paging: one contiguous KV array per request."""

    def __init__(self, weights: ModelWeights) -> None:
        self.weights = weights
        self.config = weights.config
        self._seq: Optional[DenseSequence] = None

    def sequence(self, capacity: int = 64) -> DenseSequence:
        """A new empty :class:`DenseSequence` of ``capacity`` positions."""
        return DenseSequence(self.weights, capacity)

    def prompt_logits(self, prompt) -> np.ndarray:
        """Logits after the last prompt token (same numbers as a paged prefill)."""
        return DenseSequence(self.weights, len(prompt)).feed_logits(prompt)

    def generate(self, prompt, max_new_tokens: int, eos_token_id: Optional[int] = None, *,
                 stop_token_ids: Sequence[int] = (), sampling: Optional[SamplingParams] = None,
                 request_id: int = 0) -> List[int]:
        """Decoding: at most ``max_new_tokens`` tokens, stopping after ``eos_token_id`` or any of
        ``stop_token_ids`` (included).  ``sampling`` (default greedy) picks each token, keyed by
        ``request_id`` and the token's position exactly as the paged step runner keys it."""
        max_new = _as_int(max_new_tokens, "max_new_tokens")
        if max_new < 0:
            raise ValueError("max_new_tokens must be >= 0")
        prompt = np.asarray(prompt).reshape(-1).tolist()
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        params = GREEDY if sampling is None else sampling
        rid = np.asarray([_as_int(request_id, "request_id")], dtype=np.uint64)
        stops = {int(t) for t in stop_token_ids}
        if eos_token_id is not None:
            stops.add(int(eos_token_id))
        if max_new == 0:
            return []
        seq = DenseSequence(self.weights, len(prompt) + max_new)

        def pick(logits: np.ndarray) -> int:
            return int(sample_tokens(logits[None], params, rid, [seq.length])[0])

        out = [pick(seq.feed_logits(prompt))]
        while len(out) < max_new and out[-1] not in stops:
            out.append(pick(seq.feed_logits([out[-1]])))
        return out

    def generate_with_logprobs(self, prompt, max_new_tokens: int, **kw) -> Tuple[List[int],
                                                                                 List[float]]:
        """:meth:`generate`, plus the model log-probability of each generated token."""
        out = self.generate(prompt, max_new_tokens, **kw)
        if not out:
            return out, []
        seq = DenseSequence(self.weights, len(prompt) + len(out))
        lps = [float(log_softmax(seq.feed_logits(prompt)[None])[0, out[0]])]
        for prev, tok in zip(out, out[1:]):
            lps.append(float(log_softmax(seq.feed_logits([prev])[None])[0, tok]))
        return out, lps

    def beam_search(self, prompt, beam_width: int, max_new_tokens: int,
                    eos_token_id: Optional[int] = None, *, stop_token_ids: Sequence[int] = ()
                    ) -> List[BeamHypothesis]:
        """Dense beam search, the reference of the beam policy over forks.

        ``beam_width`` W slots hold live or finished beams.  Start: one live beam, the prompt.
        Each step, every live beam proposes its W best next tokens (model log-probabilities,
        :func:`log_softmax`); a candidate scores its beam's cumulative log-probability plus the
        token's.  Candidates are ranked by score (ties: the earlier beam, then the lower id)
        and the best ``W - finished`` survive, in that order; a survivor whose token is
        ``eos_token_id`` or a stop id, or whose output reaches ``max_new_tokens``, is finished.
        Ends when no live beam remains.  Returns the finished beams, best first (ties: finished
        earlier first): ``result[0]`` is the best sequence."""
        width = _as_int(beam_width, "beam_width")
        max_new = _as_int(max_new_tokens, "max_new_tokens")
        if width < 1 or width > self.config.vocab:
            raise ValueError(f"beam_width must be in [1, vocab={self.config.vocab}]")
        if max_new < 1:
            raise ValueError("max_new_tokens must be >= 1")
        prompt = np.asarray(prompt).reshape(-1).tolist()
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        stops = {int(t) for t in stop_token_ids}
        if eos_token_id is not None:
            stops.add(int(eos_token_id))
        root = DenseSequence(self.weights, len(prompt) + max_new)
        # (cumulative logprob, tokens, sequence, logits after it)
        live: List[Tuple[float, List[int], DenseSequence, np.ndarray]] = [
            (0.0, [], root, root.feed_logits(prompt))]
        finished: List[BeamHypothesis] = []
        while live:
            cands: List[Tuple[float, int, int]] = []
            for bi, (score, _toks, _, logits) in enumerate(live):
                ids, lps = _topk_of(log_softmax(logits[None]), width)
                cands.extend((score + float(lp), bi, int(t)) for t, lp in zip(ids[0], lps[0]))
            cands.sort(key=lambda c: (-c[0], c[1], c[2]))
            survivors = []
            for score, bi, tok in cands[: width - len(finished)]:
                toks = live[bi][1] + [tok]
                if tok in stops or len(toks) >= max_new:
                    finished.append(BeamHypothesis(toks, score))
                else:
                    seq = live[bi][2].fork()
                    survivors.append((score, toks, seq, seq.feed_logits([tok])))
            live = survivors
        order = sorted(range(len(finished)), key=lambda i: (-finished[i].logprob, i))
        return [finished[i] for i in order]

    # incremental convenience API over one internal sequence
    def start(self, prompt) -> int:
        """Prefill ``prompt`` into a new sequence of this model and return the first greedy
        token."""
        self._seq = DenseSequence(self.weights, len(prompt) + 64)
        return self._seq.start(prompt)

    def step(self, token: int) -> int:
        """Feed one token to the sequence :meth:`start` began; return the next greedy token."""
        if self._seq is None:
            raise ValueError("call start(prompt) first")
        return self._seq.step(token)

