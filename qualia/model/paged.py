"""A tiny decoder-only transformer in numpy: a paged-attention backend (step runner and v1
decode rounds) and a dense model (the reference).

This is a *test model*, not a fast one: it exists so that the scheduler core can be tested
end to end against real attention over a paged KV cache (prefix sharing, copy-on-write, page
reuse, preemption and recompute), with the answer checked token for token against the same model
run without paging.

Model (all float64 by default, weights drawn from ``numpy.random.default_rng(seed)``)::

    x = embed[token]
    per layer:  h = rmsnorm(x) ; q, k, v = h @ Wqkv ; rotary positions on q, k
                a = causal softmax attention of q over k, v of positions 0..p
                x = x + a @ Wo ; x = x + silu(rmsnorm(x) @ Wup) @ Wdown
    logits = rmsnorm(x) @ unembed ; next token = argmax (ties -> lowest id), or seeded sampling

Exactness.  Every path runs tokens through the very same function,
:meth:`ModelWeights.forward_rows`: one forward over a flat batch of token rows, each row with its
own position and its own sequence to attend.  The paged step runner
(:meth:`PagedModelBackend.execute_step`: prefill chunks and decodes of many requests in one
forward), the v1 decode round and prefill, and the dense model (one contiguous KV array per
sequence) differ only in where K/V are stored and read.  The numerics are chosen so that a row's
numbers depend on its own token, position and context only, never on the other rows, on how
many rows there are, or on how the prompt was chunked:

* no BLAS: a matrix product is a sequential sum over the inner dimension of elementwise products
  (the same numbers as ``(x[:, None] * w).sum(axis=0)`` for one vector);
* attention masks the keys past a row's position and reduces over keys sequentially (the
  softmax normaliser is a cumulative sum read at the row's position), so keys past it add exact
  zeros; other reductions run over a fixed-size axis of the row (``head_dim``, ``d_model``).

Hence the paged and dense paths produce bit-identical logits, hence identical tokens, greedy or
sampled (seeded sampling is keyed by ``(seed, request id, position)``, :class:`SamplingParams`).
With two or more heads the numbers are also those of the original one-token-at-a-time
formulation (tests/test_model_step.py keeps a copy of it).

KV cache layout of the paged backend: one array ``kv[num_blocks, layers, 2, page_tokens, heads,
head_dim]`` (axis 2: 0 = K, 1 = V); the first axis is the physical page id.  The K/V of logical
position ``p`` lives at ``kv[block_table[p // page_tokens], :, :, p % page_tokens]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .._types import RaggedBatchReceipt

__all__ = [
    "GREEDY",
    "SamplingParams",
    "sample_tokens",
    "sampling_uniforms",
    "log_softmax",
    "ModelConfig",
    "LayerWeights",
    "ModelWeights",
    "PagedModelBackend",
    "DenseModel",
    "DenseSequence",
    "BeamHypothesis",
]

_U32_MAX = 2**32 - 1


# --------------------------------------------------------------------------------------------
# configuration and weights
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny transformer.  ``d_model = heads * head_dim``; MLP hidden is
    ``mlp_ratio * d_model``."""

    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    vocab: int = 512
    seed: int = 0
    rope_base: float = 10000.0
    dtype: str = "float64"
    mlp_ratio: int = 4
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "head_dim", "vocab", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise ValueError("ModelConfig.head_dim must be even (rotary embedding)")
        if self.vocab > _U32_MAX + 1:
            raise ValueError("ModelConfig.vocab must fit token ids in u32")
        if not self.rope_base > 1.0:
            raise ValueError("ModelConfig.rope_base must be > 1")
        if np.dtype(self.dtype).kind != "f":
            raise ValueError(f"ModelConfig.dtype must be a float dtype, got {self.dtype!r}")

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.d_model


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [d]
    wqkv: np.ndarray  # [d, 3d]   (q | k | v), each head-major [heads, head_dim]
    wo: np.ndarray  # [d, d]
    mlp_norm: np.ndarray  # [d]
    w_up: np.ndarray  # [d, f]
    w_down: np.ndarray  # [f, d]

    def arrays(self) -> Tuple[np.ndarray, ...]:
        return (self.attn_norm, self.wqkv, self.wo, self.mlp_norm, self.w_up, self.w_down)


_SMALL_MATMUL = 1 << 17  # products held at once by the one-reduction form of _rows_matmul


def _rows_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` for rows ``x [T, k]`` and ``w [k, m]`` without BLAS: an explicit sequential
    sum over ``k`` of elementwise products, so every row's numbers depend on that row alone (no
    blocking that changes with the batch) and equal the single-vector form
    ``(x[:, None] * w).sum(axis=0)``."""
    if x.shape[0] * w.size <= _SMALL_MATMUL:
        # the same sequential sum over k as one numpy reduction (k is the outer axis)
        return (x[:, :, None] * w[None]).sum(axis=1)
    xt = np.ascontiguousarray(x.T)  # [k, T]: one contiguous column per step
    acc = xt[0][:, None] * w[0]
    tmp = np.empty_like(acc)
    for j in range(1, w.shape[0]):
        np.multiply(xt[j][:, None], w[j], out=tmp)
        acc += tmp
    return acc


def _rows_rmsnorm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """RMS norm of every row of ``x [T, d]`` (the mean is a reduction over the row only)."""
    return x * (gain / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rows_attend(q: np.ndarray, pos: np.ndarray, keys: np.ndarray, values: np.ndarray,
                 scale: float) -> np.ndarray:
    """Causal softmax attention of queries ``q [n, H, D]`` at positions ``pos [n]`` over
    ``keys, values [n or 1, L, H, D]`` (key ``j`` holds position ``j``; ``L > max(pos)``).

    Query ``i`` sees keys ``0..pos[i]``; keys past it are masked (score ``-inf``, weight 0).
    Every reduction over keys is sequential in key order (the normaliser is a cumulative sum read
    at ``pos[i]``; the weighted sum keeps the key axis outside a contiguous ``H * D`` block), so
    the masked tail adds exact zeros and a row's result does not depend on ``L`` or on the other
    rows.  With one query this is exactly the per-token formulation ``softmax(k.q) @ v``.
    """
    n, length = q.shape[0], keys.shape[1]
    scores = (keys * q[:, None]).sum(axis=-1) * scale  # [n, L, H]
    past = np.arange(length)[None, :] > pos[:, None]  # [n, L]
    if past.any():
        scores = np.where(past[:, :, None], -np.inf, scores)
    scores = scores - scores.max(axis=1, keepdims=True)
    e = np.exp(scores)
    rows = np.arange(n)
    denom = np.cumsum(e, axis=1)[rows, pos]  # [n, H]
    w = e / denom[:, None, :]
    return (w[:, :, :, None] * values).sum(axis=1)


# elements of the largest [rows, keys, heads, head_dim] temporary of one attention block
_ATTEND_BUDGET = 1 << 19


def _row_blocks(pos: np.ndarray, per_key: int):
    """Split rows ``0..len(pos)`` into contiguous blocks ``(a, b, keys)`` whose attention
    temporaries (``rows * keys * per_key`` elements, ``keys = max(pos[a:b]) + 1``) stay
    within the budget (a single row may exceed it)."""
    total = len(pos)
    a = 0
    while a < total:
        b = min(total, a + max(1, _ATTEND_BUDGET // ((int(pos[a]) + 1) * per_key)))
        keys = int(pos[a:b].max()) + 1
        while b - a > 1 and (b - a) * keys * per_key > _ATTEND_BUDGET:
            b = a + max(1, (b - a) // 2)
            keys = int(pos[a:b].max()) + 1
        yield a, b, keys
        a = b


class ModelWeights:
    """Weights of the tiny transformer, plus the single per-token forward function both the
    paged and the dense paths use."""

    def __init__(
        self,
        config: ModelConfig,
        embed: np.ndarray,
        layers: Sequence[LayerWeights],
        final_norm: np.ndarray,
        unembed: np.ndarray,
    ) -> None:
        d, v = config.d_model, config.vocab
        if embed.shape != (v, d) or unembed.shape != (d, v) or final_norm.shape != (d,):
            raise ValueError("weight shapes do not match the config")
        if len(layers) != config.layers:
            raise ValueError("number of layers does not match the config")
        self.config = config
        self.dtype = np.dtype(config.dtype)
        self.embed = embed
        self.layers = list(layers)
        self.final_norm = final_norm
        self.unembed = unembed
        half = config.head_dim // 2
        self._inv_freq = (1.0 / (config.rope_base ** (np.arange(half, dtype=np.float64) / half)))
        self._rope_len = 0
        self._rope_cos = np.zeros((0, half), dtype=self.dtype)
        self._rope_sin = np.zeros((0, half), dtype=self.dtype)
        self._scale = 1.0 / math.sqrt(config.head_dim)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def random(cls, config: Optional[ModelConfig] = None) -> "ModelWeights":
        """Deterministic random weights: the same config (seed included) gives the same
        weights, bit for bit."""
        if config is None:
            config = ModelConfig()
        rng = np.random.default_rng(config.seed)
        dt = np.dtype(config.dtype)
        d, f, v = config.d_model, config.mlp_hidden, config.vocab

        def normal(shape, std):
            return (rng.standard_normal(shape) * std).astype(dt)

        def gain(n):
            return (1.0 + 0.1 * rng.standard_normal(n)).astype(dt)

        embed = normal((v, d), 1.0)
        layers = []
        for _ in range(config.layers):
            layers.append(
                LayerWeights(
                    attn_norm=gain(d),
                    wqkv=normal((d, 3 * d), 1.0 / math.sqrt(d)),
                    wo=normal((d, d), 1.0 / math.sqrt(d)),
                    mlp_norm=gain(d),
                    w_up=normal((d, f), 1.0 / math.sqrt(d)),
                    w_down=normal((f, d), 1.0 / math.sqrt(f)),
                )
            )
        final_norm = gain(d)
        unembed = normal((d, v), 1.0 / math.sqrt(d))
        return cls(config, embed, layers, final_norm, unembed)

    def arrays(self) -> List[np.ndarray]:
        """Every weight array, in a fixed order (for comparisons)."""
        out = [self.embed]
        for layer in self.layers:
            out.extend(layer.arrays())
        out.extend([self.final_norm, self.unembed])
        return out

    def equal(self, other: "ModelWeights") -> bool:
        a, b = self.arrays(), other.arrays()
        return self.config == other.config and all(np.array_equal(x, y) for x, y in zip(a, b))

    # -- numerics ---------------------------------------------------------------------------

    def rope(self, position: int) -> Tuple[np.ndarray, np.ndarray]:
        """(cos, sin) of the rotary angles at ``position``, each ``[head_dim // 2]``."""
        cos, sin = self.rope_rows(np.asarray([_as_int(position, "position")], dtype=np.int64))
        return cos[0], sin[0]

    def rope_rows(self, positions: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(cos, sin) ``[T, head_dim // 2]`` for ``positions [T]`` (from a table that grows by
        doubling; each entry is ``cos(position * inv_freq)`` whatever the table size)."""
        need = int(positions.max()) + 1 if len(positions) else 0
        if need > self._rope_len:
            size = max(need, 2 * self._rope_len, 64)
            angles = np.arange(size, dtype=np.float64)[:, None] * self._inv_freq[None, :]
            self._rope_cos = np.cos(angles).astype(self.dtype)
            self._rope_sin = np.sin(angles).astype(self.dtype)
            self._rope_len = size
        return self._rope_cos[positions], self._rope_sin[positions]

    @staticmethod
    def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate((x1 * cos - x2 * sin, x1 * sin + x2 * cos), axis=-1)

    def check_token(self, token: int) -> int:
        token = _as_int(token, "token id")
        if not 0 <= token < self.config.vocab:
            raise ValueError(f"token id {token} out of range for vocab {self.config.vocab}")
        return token

    def check_tokens(self, tokens, what: str = "token ids") -> np.ndarray:
        """``tokens`` as an int64 array, every id in ``[0, vocab)`` (ValueError otherwise)."""
        arr = np.asarray(tokens)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.dtype.kind not in "ui" or arr.dtype == np.bool_:
            return np.asarray([self.check_token(t) for t in arr.reshape(-1).tolist()], np.int64)
        arr = arr.reshape(-1)
        bad = (arr < 0) | (arr >= self.config.vocab)
        if bad.any():
            tok = int(arr[np.argmax(bad)])
            raise ValueError(f"{what}: id {tok} out of range for vocab {self.config.vocab}")
        return arr.astype(np.int64)

    def forward_rows(self, tokens: np.ndarray, positions: np.ndarray, attend,
                     out_rows: Optional[np.ndarray] = None) -> np.ndarray:
        """One forward pass over a flat batch of token rows: ``tokens [T]`` at ``positions
        [T]`` (int64, validated by the caller).  ``attend(layer, q, k, v)`` gets this layer's
        ``q, k, v [T, H, D]`` (rotary applied), must store ``k, v`` where each row's sequence
        keeps them, and return each row's attention output ``[T, H, D]`` over its own sequence
        up to its position (see :func:`_rows_attend`).  Returns the logits ``[len(out_rows),
        vocab]`` of the rows ``out_rows`` (default: every row).

        Every row's numbers depend only on its own token, position and context, never on the
        other rows of the batch: the paged step runner, the v1 round, the prefill and the dense
        model all call this, so they agree bit for bit."""
        c = self.config
        t = len(tokens)
        d, h, hd = c.d_model, c.heads, c.head_dim
        eps = c.norm_eps
        x = self.embed[tokens]  # [T, d] (a copy)
        cos, sin = self.rope_rows(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        for li, lw in enumerate(self.layers):
            hn = _rows_rmsnorm(x, lw.attn_norm, eps)
            qkv = _rows_matmul(hn, lw.wqkv)
            q = self._apply_rope(qkv[:, :d].reshape(t, h, hd), cos, sin)
            k = self._apply_rope(qkv[:, d : 2 * d].reshape(t, h, hd), cos, sin)
            v = np.ascontiguousarray(qkv[:, 2 * d :].reshape(t, h, hd))
            attn = attend(li, q, k, v).reshape(t, d)
            x = x + _rows_matmul(attn, lw.wo)
            hn = _rows_rmsnorm(x, lw.mlp_norm, eps)
            up = _rows_matmul(hn, lw.w_up)
            up = up / (1.0 + np.exp(-up))  # SiLU
            x = x + _rows_matmul(up, lw.w_down)
        if out_rows is not None:
            x = x[out_rows]
        x = _rows_rmsnorm(x, self.final_norm, eps)
        return _rows_matmul(x, self.unembed)

    def forward_token(self, token: int, position: int, kv) -> np.ndarray:
        """Logits ``[vocab]`` after ``token`` at ``position`` (one row of :meth:`forward_rows`).

        ``kv.write_read(layer, position, k, v)`` must store this token's ``k, v [H, D]`` and
        return ``(K, V)``, the K/V of positions ``0..position`` as ``[position + 1, H, D]``
        arrays.
        """
        token = self.check_token(token)
        pos = np.asarray([_as_int(position, "position")], dtype=np.int64)

        def attend(layer, q, k, v):
            keys, values = kv.write_read(layer, int(pos[0]), k[0], v[0])
            return _rows_attend(q, pos, np.asarray(keys)[None], np.asarray(values)[None],
                                self._scale)

        return self.forward_rows(np.asarray([token], np.int64), pos, attend)[0]

    def full_forward_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits ``[n, vocab]`` of a whole sequence in one batched causal pass (BLAS matmuls).

        An independent formulation used to validate the incremental path; it agrees to rounding,
        not bit for bit.
        """
        c = self.config
        toks = np.asarray([self.check_token(t) for t in tokens], dtype=np.int64)
        n, d, h, hd = len(toks), c.d_model, c.heads, c.head_dim
        pos = np.arange(n, dtype=np.float64)[:, None] * self._inv_freq[None, :]
        cos, sin = np.cos(pos)[:, None, :], np.sin(pos)[:, None, :]  # [n, 1, hd/2]
        mask = np.triu(np.ones((n, n), dtype=bool), k=1)

        def norm(x, g):
            return x * (g / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_eps))

        x = self.embed[toks].astype(np.float64)
        for lw in self.layers:
            qkv = norm(x, lw.attn_norm) @ lw.wqkv
            q = self._apply_rope(qkv[:, :d].reshape(n, h, hd), cos, sin)
            k = self._apply_rope(qkv[:, d : 2 * d].reshape(n, h, hd), cos, sin)
            v = qkv[:, 2 * d :].reshape(n, h, hd)
            s = np.einsum("qhd,khd->hqk", q, k) * self._scale
            s = np.where(mask[None], -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            w = np.exp(s)
            w = w / w.sum(axis=-1, keepdims=True)
            a = np.einsum("hqk,khd->qhd", w, v).reshape(n, d)
            x = x + a @ lw.wo
            up = norm(x, lw.mlp_norm) @ lw.w_up
            x = x + (up / (1.0 + np.exp(-up))) @ lw.w_down
        return norm(x, self.final_norm) @ self.unembed


def _as_int(value, what: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer, not bool")
    try:
        return int(value.__index__())
    except AttributeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None


def _greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # first maximum: ties go to the lowest token id


# --------------------------------------------------------------------------------------------
# sampling and log-probabilities
# --------------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class SamplingParams:
    """How a next token is chosen from logits.

    ``temperature == 0`` (the default): greedy, the argmax (ties -> lowest id).  Otherwise one
    draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely ids
    (``0``: all; ties at the cut are all kept), by inverse CDF of ONE uniform number that is a
    pure function of ``(seed, request_id, position)``, where ``position`` is the sequence
    position of the token being sampled.  So a request's tokens do not depend on batching,
    chunking, preemption or on the other requests, and forked children (distinct request ids)
    draw independent streams from the same seed."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite float >= 0, got {t!r}")
        for name, hi in (("seed", 2**64), ("top_k", 2**31)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < hi:
                raise ValueError(f"SamplingParams.{name} must be an int in [0, {hi}), got "
                                 f"{value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def sampling_uniforms(seed: int, request_ids, positions) -> np.ndarray:
    """The uniform numbers in ``[0, 1)`` that seeded sampling uses for rows ``(request_id,
    position)`` (a splitmix64 hash of ``(seed, request_id, position)``)."""
    rid = np.asarray(request_ids).astype(np.uint64).reshape(-1)
    pos = np.asarray(positions).astype(np.uint64).reshape(-1)
    h = _mix64(np.full(len(rid), seed, dtype=np.uint64))
    h = _mix64(_mix64(h ^ rid) ^ pos)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``logits [m, vocab]`` (float64): the model's log-probabilities
    at temperature 1 (what :meth:`PagedModelBackend.execute_step` and :meth:`topk` return)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sample_tokens(logits: np.ndarray, params: SamplingParams, request_ids, positions
                  ) -> np.ndarray:
    """The token ids ``uint32 [m]`` that ``params`` picks from ``logits [m, vocab]`` for rows
    ``(request_ids[i], positions[i])`` (see :class:`SamplingParams`)."""
    logits = np.asarray(logits, dtype=np.float64)
    m, vocab = logits.shape
    if params.greedy or m == 0:
        return np.argmax(logits, axis=-1).astype(np.uint32) if m else np.zeros(0, np.uint32)
    z = logits / params.temperature
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    if 0 < params.top_k < vocab:
        kth = np.partition(z, vocab - params.top_k, axis=-1)[:, vocab - params.top_k]
        p = np.where(z >= kth[:, None], p, 0.0)
    cdf = np.cumsum(p, axis=-1)  # sequential: the same numbers whatever the batch
    target = sampling_uniforms(params.seed, request_ids, positions) * cdf[:, -1]
    idx = (cdf <= target[:, None]).sum(axis=-1)  # first id whose cdf passes the target
    last = vocab - 1 - np.argmax(p[:, ::-1] > 0, axis=-1)  # (rounding guard)
    return np.minimum(idx, last).astype(np.uint32)


def _topk_of(logprobs: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]  # ties -> lower id first
    return order.astype(np.uint32), np.take_along_axis(logprobs, order, axis=-1)


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

    ``kv`` has shape ``[num_blocks, layers, 2, page_tokens, heads, head_dim]``; page ids index
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

    def __init__(self, weights: ModelWeights, num_blocks: int, page_tokens: int, *,
                 sampling: SamplingParams = GREEDY, page_table: str = "block_table") -> None:
        num_blocks = _as_int(num_blocks, "num_blocks")
        page_tokens = _as_int(page_tokens, "page_tokens")
        if num_blocks < 1 or page_tokens < 1:
            raise ValueError("num_blocks and page_tokens must be >= 1")
        if num_blocks > _U32_MAX:
            raise OverflowError("num_blocks must fit page ids in u32")
        if not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be a SamplingParams")
        if page_table not in ("block_table", "csr"):
            raise ValueError("page_table must be 'block_table' or 'csr'")
        c = weights.config
        self.weights = weights
        self.config = c
        self.num_blocks = num_blocks
        self.page_tokens = page_tokens
        self.sampling = sampling
        self.page_table = page_table
        self._request_sampling: Dict[int, SamplingParams] = {}
        self.kv = np.zeros(
            (num_blocks, c.layers, 2, page_tokens, c.heads, c.head_dim), dtype=weights.dtype
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
        return self.kv[0].nbytes

    def _check_pages(self, pages: np.ndarray, what: str) -> None:
        if len(pages) and int(pages.max()) >= self.num_blocks:
            bad = int(pages[np.argmax(pages >= self.num_blocks)])
            raise ValueError(f"{what}: page id {bad} out of range (num_blocks={self.num_blocks})")

    def _copy_ops(self, copies) -> Tuple[np.ndarray, np.ndarray]:
        if isinstance(copies, np.ndarray) and copies.dtype.names:
            src = _field(copies, "src_page", "copies").astype(np.int64).reshape(-1)
            dst = _field(copies, "dst_page", "copies").astype(np.int64).reshape(-1)
        else:
            pairs = [(_as_int(s, "src_page"), _as_int(d, "dst_page")) for s, d in copies]
            src = np.asarray([s for s, _ in pairs], dtype=np.int64)
            dst = np.asarray([d for _, d in pairs], dtype=np.int64)
        for arr, what in ((src, "src_page"), (dst, "dst_page")):
            if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= self.num_blocks):
                raise ValueError(f"copy_pages: {what} out of range (num_blocks={self.num_blocks})")
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
            k_pages, v_pages = kv[:, layer, 0], kv[:, layer, 1]  # [num_blocks, pt, H, D]
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
        bad = valid & ((tables < 0) | (tables >= self.num_blocks))
        if bad.any():
            i = int(np.argmax(bad.any(axis=1)))
            page = int(tables[i][bad[i]][0])
            raise ValueError(f"item {i} block table: page id {page} out of range "
                             f"(num_blocks={self.num_blocks})")

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
        return self._request_sampling.get(int(request_id), self.sampling)

    def check_plan(self, plan):
        """Validate a step plan against itself and this backend; returns the arrays the
        forward needs.  ValueError/TypeError on any inconsistency (nothing is written)."""
        pt, nb = self.page_tokens, self.num_blocks
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
                raise ValueError(f"plan.block_table: page id out of range (num_blocks={nb})")
        if self.page_table == "csr" and ((tables < 0) | (tables >= nb))[valid].any():
            raise ValueError(f"plan.kv_indices: page id out of range (num_blocks={nb})")
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
    logprob: float


class DenseModel:
    """The same model without paging: one contiguous KV array per request."""

    def __init__(self, weights: ModelWeights) -> None:
        self.weights = weights
        self.config = weights.config
        self._seq: Optional[DenseSequence] = None

    def sequence(self, capacity: int = 64) -> DenseSequence:
        return DenseSequence(self.weights, capacity)

    def prompt_logits(self, prompt) -> np.ndarray:
        """Logits after the last prompt token (same numbers as a paged prefill)."""
        return DenseSequence(self.weights, len(prompt)).feed_logits(prompt)

    def generate(self, prompt, max_new_tokens: int, end_token: Optional[int] = None, *,
                 stop_token_ids: Sequence[int] = (), sampling: Optional[SamplingParams] = None,
                 request_id: int = 0) -> List[int]:
        """Decoding: at most ``max_new_tokens`` tokens, stopping after ``end_token`` or any of
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
        if end_token is not None:
            stops.add(int(end_token))
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
                    end_token: Optional[int] = None, *, stop_token_ids: Sequence[int] = ()
                    ) -> List[BeamHypothesis]:
        """Dense beam search, the reference of the beam policy over forks (issue 15).

        ``beam_width`` W slots hold live or finished beams.  Start: one live beam, the prompt.
        Each step, every live beam proposes its W best next tokens (model log-probabilities,
        :func:`log_softmax`); a candidate scores its beam's cumulative log-probability plus the
        token's.  Candidates are ranked by score (ties: the earlier beam, then the lower id)
        and the best ``W - finished`` survive, in that order; a survivor whose token is
        ``end_token`` or a stop id, or whose output reaches ``max_new_tokens``, is finished.
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
        if end_token is not None:
            stops.add(int(end_token))
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
        self._seq = DenseSequence(self.weights, len(prompt) + 64)
        return self._seq.start(prompt)

    def step(self, token: int) -> int:
        if self._seq is None:
            raise ValueError("call start(prompt) first")
        return self._seq.step(token)
