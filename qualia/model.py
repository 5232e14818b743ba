"""A tiny decoder-only transformer in numpy, with a paged-attention backend and a dense model.

This is a *test model*, not a fast one: it exists so that the scheduler core can be tested
end to end against real attention over a paged KV cache (prefix sharing, copy-on-write, page
reuse, preemption and recompute), with the answer checked token for token against the same model
run without paging.

Model (all float64 by default, weights drawn from ``numpy.random.default_rng(seed)``)::

    x = embed[token]
    per layer:  h = rmsnorm(x) ; q, k, v = h @ Wqkv ; rotary positions on q, k
                a = causal softmax attention of q over k, v of positions 0..p
                x = x + a @ Wo ; x = x + silu(rmsnorm(x) @ Wup) @ Wdown
    logits = rmsnorm(x) @ unembed ; next token = argmax (ties -> lowest id)

Exactness.  :class:`PagedModelBackend` and :class:`DenseModel` run every token through the very
same function (:meth:`ModelWeights.forward_token`), one token at a time (prefill too), and hand it
the K/V of positions ``0..p`` as C-contiguous ``[p + 1, heads, head_dim]`` arrays holding the same
values (gathered from the pages, or sliced from the dense buffer).  Every matrix product is an
elementwise multiply followed by a numpy reduction (no BLAS), so the result depends only on the
values, shapes and strides, never on memory alignment, threading or the BLAS build: the paged and
dense paths produce bit-identical logits, hence identical greedy tokens.

KV cache layout of the paged backend: one array ``kv[num_blocks, layers, 2, page_tokens, heads,
head_dim]`` (axis 2: 0 = K, 1 = V); the first axis is the physical page id.  The K/V of logical
position ``p`` lives at ``kv[block_table[p // page_tokens], :, :, p % page_tokens]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._types import RaggedBatchReceipt

__all__ = [
    "ModelConfig",
    "LayerWeights",
    "ModelWeights",
    "PagedModelBackend",
    "DenseModel",
    "DenseSequence",
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


def _matvec(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w`` for a vector ``x [n]`` and ``w [n, m]`` without BLAS (see module docstring)."""
    return (x[:, None] * w).sum(axis=0)


def _rmsnorm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    return x * (gain / np.sqrt(np.mean(x * x) + eps))


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Softmax attention of one query ``q [H, D]`` over ``k, v [T, H, D]`` -> ``[H, D]``."""
    scores = (k * q).sum(axis=-1) * scale  # [T, H]
    scores = scores - scores.max(axis=0)
    e = np.exp(scores)
    w = e / e.sum(axis=0)  # [T, H]
    return (w[:, :, None] * v).sum(axis=0)


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
        self._rope_cache: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
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
        cached = self._rope_cache.get(position)
        if cached is None:
            angles = float(position) * self._inv_freq
            cached = (np.cos(angles).astype(self.dtype), np.sin(angles).astype(self.dtype))
            self._rope_cache[position] = cached
        return cached

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

    def forward_token(self, token: int, position: int, kv) -> np.ndarray:
        """Logits ``[vocab]`` after ``token`` at ``position``.

        ``kv.write_read(layer, position, k, v)`` must store this token's ``k, v [H, D]`` and
        return ``(K, V)``, the K/V of positions ``0..position`` as C-contiguous
        ``[position + 1, H, D]`` arrays.  Both the paged and the dense path call this.
        """
        c = self.config
        d, h, hd = c.d_model, c.heads, c.head_dim
        eps = c.norm_eps
        x = self.embed[token].copy()
        cos, sin = self.rope(position)
        for li, lw in enumerate(self.layers):
            hn = _rmsnorm(x, lw.attn_norm, eps)
            qkv = _matvec(hn, lw.wqkv)
            q = self._apply_rope(qkv[:d].reshape(h, hd), cos, sin)
            k = self._apply_rope(qkv[d : 2 * d].reshape(h, hd), cos, sin)
            v = qkv[2 * d :].reshape(h, hd)
            keys, values = kv.write_read(li, position, k, v)
            attn = _attend(q, keys, values, self._scale).reshape(d)
            x = x + _matvec(attn, lw.wo)
            hn = _rmsnorm(x, lw.mlp_norm, eps)
            up = _matvec(hn, lw.w_up)
            up = up / (1.0 + np.exp(-up))  # SiLU
            x = x + _matvec(up, lw.w_down)
        x = _rmsnorm(x, self.final_norm, eps)
        return _matvec(x, self.unembed)

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
# paged backend
# --------------------------------------------------------------------------------------------


class _PagedKv:
    """K/V accessor of one sequence over the page cache (see ``forward_token``)."""

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


class PagedModelBackend:
    """The tiny transformer over a paged KV cache, driven by block tables.

    ``kv`` has shape ``[num_blocks, layers, 2, page_tokens, heads, head_dim]``; page ids index
    its first axis.  The backend owns no allocation policy: callers (the scheduler / engine)
    decide which pages a sequence uses and perform copy-on-write via :meth:`copy_pages`.

    Counters: ``rounds`` (``execute_ragged`` calls), ``items_executed``, ``tokens_prefilled``,
    ``pages_copied``.
    """

    def __init__(self, weights: ModelWeights, num_blocks: int, page_tokens: int) -> None:
        num_blocks = _as_int(num_blocks, "num_blocks")
        page_tokens = _as_int(page_tokens, "page_tokens")
        if num_blocks < 1 or page_tokens < 1:
            raise ValueError("num_blocks and page_tokens must be >= 1")
        if num_blocks > _U32_MAX:
            raise OverflowError("num_blocks must fit page ids in u32")
        c = weights.config
        self.weights = weights
        self.config = c
        self.num_blocks = num_blocks
        self.page_tokens = page_tokens
        self.kv = np.zeros(
            (num_blocks, c.layers, 2, page_tokens, c.heads, c.head_dim), dtype=weights.dtype
        )
        self.rounds = 0
        self.items_executed = 0
        self.tokens_prefilled = 0
        self.pages_copied = 0

    # -- pages -------------------------------------------------------------------------------

    @property
    def page_nbytes(self) -> int:
        return self.kv[0].nbytes

    def _check_pages(self, pages: np.ndarray, what: str) -> None:
        if len(pages) and int(pages.max()) >= self.num_blocks:
            bad = int(pages[np.argmax(pages >= self.num_blocks)])
            raise ValueError(f"{what}: page id {bad} out of range (num_blocks={self.num_blocks})")

    def copy_pages(self, copies) -> int:
        """Copy physical pages ``src_page -> dst_page`` in order (a ``COPY_OP`` array, or any
        sequence of ``(src, dst)`` pairs).  Returns the number of pages copied."""
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
        for s, d in zip(src.tolist(), dst.tolist()):
            if s != d:
                self.kv[d] = self.kv[s]
        self.pages_copied += len(src)
        return len(src)

    def _pages(self, block_table, what: str = "block_table") -> np.ndarray:
        pages = np.asarray(block_table)
        if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "ui"):
            raise TypeError(f"{what} must be a 1-D integer array of page ids")
        if pages.size and int(pages.min()) < 0:
            raise ValueError(f"{what}: negative page id")
        pages = pages.astype(np.int64, copy=False)
        self._check_pages(pages, what)
        return pages

    # -- prefill ------------------------------------------------------------------------------

    def prefill_logits(self, tokens, start_position: int, block_table) -> np.ndarray:
        """Write the K/V of ``tokens`` at positions ``start_position ..`` and return the logits
        after the last one.  ``block_table`` is the sequence's whole logical->physical map
        (positions ``< start_position`` are read from it: e.g. shared prefix pages); it must
        cover position ``start_position + len(tokens) - 1``."""
        toks = [self.weights.check_token(t) for t in np.asarray(tokens).reshape(-1).tolist()]
        if not toks:
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
        kv = _PagedKv(self.kv, pages, self.page_tokens)
        for i, tok in enumerate(toks[:-1]):
            self.weights.forward_token(tok, start + i, kv)
        logits = self.weights.forward_token(toks[-1], last, kv)
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
        are validated before any K/V is written."""
        items = np.asarray(items)
        if items.ndim != 1:
            raise TypeError("items must be a 1-D structured array")
        n = len(items)
        rid = _field(items, "request_id", "items")
        slot = _field(items, "slot", "items")
        tok = _field(items, "token_id", "items")
        pos = _field(items, "position", "items")
        off = _field(items, "block_table_offset", "items")
        npg = _field(items, "logical_pages", "items")
        for name in ("request_id", "slot", "next_token_id"):
            _field(outputs, name, "outputs")
        if len(outputs) < n:
            raise ValueError(f"outputs holds {len(outputs)} records, the round has {n} items")
        table = np.asarray(block_table)
        if table.ndim != 1:
            raise TypeError("block_table must be 1-D")

        work = []
        for i in range(n):
            t, p, o, lp = int(tok[i]), int(pos[i]), int(off[i]), int(npg[i])
            self.weights.check_token(t)
            if o + lp > len(table):
                raise ValueError(
                    f"item {i}: block table slice [{o}, {o + lp}) past its end ({len(table)})"
                )
            if p // self.page_tokens >= lp:
                raise ValueError(
                    f"item {i}: position {p} needs page {p // self.page_tokens}, "
                    f"only {lp} logical pages"
                )
            pages = self._pages(table[o : o + lp], f"item {i} block table")
            work.append((t, p, pages))

        for i, (t, p, pages) in enumerate(work):
            logits = self.weights.forward_token(t, p, _PagedKv(self.kv, pages, self.page_tokens))
            outputs["request_id"][i] = rid[i]
            outputs["slot"][i] = slot[i]
            outputs["next_token_id"][i] = _greedy(logits)
        self.rounds += 1
        self.items_executed += n
        return RaggedBatchReceipt(n, 1)

    __call__ = execute_ragged


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
        """Append tokens (one at a time) and return the logits after the last."""
        toks = [self.weights.check_token(t) for t in np.asarray(tokens).reshape(-1).tolist()]
        if not toks:
            raise ValueError("feed needs at least one token")
        self._reserve(self.length + len(toks))
        for tok in toks[:-1]:
            self.weights.forward_token(tok, self.length, self)
            self.length += 1
        logits = self.weights.forward_token(toks[-1], self.length, self)
        self.length += 1
        return logits

    def start(self, prompt) -> int:
        """Prefill ``prompt`` into an empty sequence; return the first generated token."""
        if self.length:
            raise ValueError("start() needs an empty sequence")
        return _greedy(self.feed_logits(prompt))

    def step(self, token: int) -> int:
        """Feed one token (normally the previous output); return the next."""
        return _greedy(self.feed_logits([token]))


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

    def generate(self, prompt, max_new_tokens: int, end_token: Optional[int] = None) -> List[int]:
        """Greedy decoding: at most ``max_new_tokens`` tokens, stopping after ``end_token``
        (which is included)."""
        max_new = _as_int(max_new_tokens, "max_new_tokens")
        if max_new < 0:
            raise ValueError("max_new_tokens must be >= 0")
        prompt = np.asarray(prompt).reshape(-1).tolist()
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if max_new == 0:
            return []
        seq = DenseSequence(self.weights, len(prompt) + max_new)
        out = [seq.start(prompt)]
        while len(out) < max_new and (end_token is None or out[-1] != end_token):
            out.append(seq.step(out[-1]))
        return out

    # incremental convenience API over one internal sequence
    def start(self, prompt) -> int:
        self._seq = DenseSequence(self.weights, len(prompt) + 64)
        return self._seq.start(prompt)

    def step(self, token: int) -> int:
        if self._seq is None:
            raise ValueError("call start(prompt) first")
        return self._seq.step(token)
