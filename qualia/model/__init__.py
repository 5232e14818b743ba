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
formulation (tests/model/test_step_runner.py keeps a copy of it).

KV cache layout of the paged backend: one array ``kv[num_pages, layers, 2, page_tokens, heads,
head_dim]`` (axis 2: 0 = K, 1 = V); the first axis is the physical page id.  The K/V of logical
position ``p`` lives at ``kv[block_table[p // page_tokens], :, :, p % page_tokens]``.
"""


from .dense import BeamHypothesis, DenseModel, DenseSequence
from .paged import PagedModelBackend
from .sampling import GREEDY, SamplingParams, log_softmax, sample_tokens, sampling_uniforms
from .weights import LayerWeights, ModelConfig, ModelWeights

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
