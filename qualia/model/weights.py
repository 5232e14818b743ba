"""The tiny decoder-only transformer's configuration and weights, and its one forward
(:meth:`ModelWeights.forward_rows`); see :mod:`qualia.model`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

_U32_MAX = 2**32 - 1

# --------------------------------------------------------------------------------------------
# configuration and weights
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the tiny transformer.  ``d_model = heads * head_dim``; MLP hidden is
    ``mlp_ratio * d_model``."""

    layers: int = 2
    """Transformer layers."""
    heads: int = 4
    head_dim: int = 16
    vocab: int = 512
    """Vocabulary size."""
    seed: int = 0
    """The seed of the weights (``numpy.random.default_rng``)."""
    rope_base: float = 10000.0
    """The rotary embedding's base."""
    dtype: str = "float64"
    """The numpy float dtype of weights and K/V."""
    mlp_ratio: int = 4
    norm_eps: float = 1e-6
    """RMSNorm's epsilon."""

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
        """The model width, ``heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width, ``mlp_ratio * d_model``."""
        return self.mlp_ratio * self.d_model


@dataclass
class LayerWeights:
    """One transformer layer's weights (``d = d_model``, ``f = mlp_hidden``)."""

    attn_norm: np.ndarray
    """``[d]``: the attention RMSNorm's gain."""
    wqkv: np.ndarray
    """``[d, 3d]``: the Q, K and V projections side by side, each head-major."""
    wo: np.ndarray
    """``[d, d]``: the attention output projection."""
    mlp_norm: np.ndarray
    """``[d]``: the MLP RMSNorm's gain."""
    w_up: np.ndarray
    """``[d, f]``: the MLP's up projection."""
    w_down: np.ndarray
    """``[f, d]``: the MLP's down projection."""

    def arrays(self) -> Tuple[np.ndarray, ...]:
        """The layer's six arrays, in field order."""
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
        """Whether ``other`` has the same configuration and equal arrays."""
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
        """``token`` as an int in ``[0, vocab)`` (``ValueError`` otherwise)."""
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

