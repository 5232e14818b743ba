"""A modeled accelerator clock: how long one engine step takes on a GPU, from the step's work.

The simulator's serving clock advances by one step's time after every step.  Measured CPU time
(microseconds of scheduling) says nothing about a GPU serving a model, and a fixed cost per step
ignores what the step computes.  :class:`ModeledClock` instead charges each step the time a
roofline model of the step's work gives on a named hardware/model :class:`Profile`.

The model
=========

A step is a fixed overhead plus two kinds of GPU work that run one after the other, each costed
with the roofline (its time is the larger of its arithmetic at an achievable fraction of peak
FLOP/s and its memory traffic at an achievable fraction of peak memory bandwidth).  The split is
the one of the LLM-serving simulators that model a step from its operators (Vidur: token-level
operators cost by the batch's tokens, sequence-level attention by each request's context):

* **linear layers** (the projections, the MLP, the LM head) over all the step's tokens ``T``:
  ``2 x linear parameters x T`` FLOPs (a multiply-add per weight per token) plus ``2 x vocab x
  hidden`` per sampled row for the LM head; the weights are read once per step
  (``step_weight_bytes``).  A decode batch is memory-bound (every weight is read for a few
  tokens), a long prefill compute-bound;
* **attention** over each request's context: ``4 x layers x heads x head_dim`` FLOPs per (query,
  key) pair (``Q K^T`` and ``P V``), with causal pairs ``q x (s - q) + q (q + 1) / 2`` for a
  request computing ``q`` tokens of a context of ``s``; its memory traffic is the context's K/V,
  read once per request per step, plus the new tokens' K/V written (``kv_bytes_per_token x
  (sum of seq_lens + T)``);
* copy-on-write page copies, when a plan has them: each page read and written once;
* a fixed **overhead** per step for the CPU side (scheduling, input preparation, sampling,
  output processing), which vLLM's own profiling of an 8B model on one H100 found to be a large
  share of a step.

In all::

    step time = overhead + max(linear FLOPs / (peak x compute_efficiency),
                               weight bytes / (bandwidth x bandwidth_efficiency))
                         + max(attention FLOPs / (peak x compute_efficiency),
                               KV bytes / (bandwidth x bandwidth_efficiency))
                         + copied bytes / (bandwidth x bandwidth_efficiency)

The step's work comes from the plan the scheduler made (:meth:`StepWork.from_plan`: its query
lengths, ``seq_lens``, sampled rows and copies) or from numbers (:meth:`StepWork.from_lens`).
Elementwise work (norms, rotary embeddings, activations), the embedding gather and the
activations' memory traffic are left out: they are small next to the weights and the K/V for
the models here.

The KV pool
===========

:meth:`Profile.kv_pages` sizes the page pool the way vLLM sizes its KV cache: the memory the
driver reports times ``memory_utilization`` (vLLM's ``gpu_memory_utilization``, 0.9), less the
weights, less an activation reserve (what vLLM's start-up profiling run finds for activations,
CUDA graphs and allocations outside PyTorch), divided by the bytes of one page (``page_tokens x
kv_bytes_per_token``), rounded down.

Profiles and where each constant comes from
===========================================

Profiles are named ``MODEL-GPU`` (:data:`PROFILES`; :func:`get_profile` refuses an unknown name
and suggests the close ones).  Models (:data:`MODELS`), from each model's published
``config.json`` on Hugging Face:

* ``llama3.1-8b`` (meta-llama/Llama-3.1-8B): ``hidden_size`` 4096, ``intermediate_size``
  14336, ``num_hidden_layers`` 32, ``num_attention_heads`` 32, ``num_key_value_heads`` 8 (head
  dim 4096 / 32 = 128), ``vocab_size`` 128256, ``max_position_embeddings`` 131072,
  ``tie_word_embeddings`` false, ``torch_dtype`` bfloat16.  :attr:`ModelShape.params` gives
  8,030,261,248, the 8.03B of the model card; the weights are 14.96 GiB, what vLLM logs when it
  loads the model.
* ``llama3.2-1b`` (meta-llama/Llama-3.2-1B): ``hidden_size`` 2048, ``intermediate_size`` 8192,
  ``num_hidden_layers`` 16, ``num_attention_heads`` 32, ``num_key_value_heads`` 8, ``head_dim``
  64, ``vocab_size`` 128256, ``max_position_embeddings`` 131072, ``tie_word_embeddings`` true,
  bfloat16 (1.24B parameters).

Accelerators (:data:`ACCELERATORS`), from NVIDIA's datasheets; the dense BF16 Tensor Core rate
is half the datasheet's "with sparsity" figure; the memory is what the driver reports
(``nvidia-smi``'s total), the amount vLLM's ``gpu_memory_utilization`` multiplies:

* ``h100`` (H100 SXM5 80GB HBM3): 989.4 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s,
  81,559 MiB;
* ``a100`` (A100 SXM4 80GB HBM2e): 312 TFLOP/s dense BF16 (624 with sparsity), 2,039 GB/s,
  81,920 MiB;
* ``h200`` (H200 SXM 141GB HBM3e): 989.4 TFLOP/s dense BF16 (1,979 with sparsity), 4.8 TB/s,
  143,771 MiB.

Achievable fractions and the overhead are modeling choices, not datasheet figures:

* ``compute_efficiency`` 0.6: BF16 GEMMs and FlashAttention kernels reach well under peak
  (FlashAttention-2 reports 50-73% of peak on an A100, FlashAttention-3 up to 75% on an H100,
  for long sequences; the linear layers of a serving step are often short or skinny GEMMs);
* ``bandwidth_efficiency`` 0.7: the achieved share of peak memory bandwidth in decode ("model
  bandwidth utilization") stays well below 1 (Databricks/MosaicML, "LLM Inference Performance
  Engineering: Best Practices", 2023);
* ``step_overhead_s`` 1 ms: the CPU side of a step (vLLM v0.6.0's performance update, 2024,
  measured scheduling and output processing as a large share of a Llama 3 8B step on one H100
  and overlapped them with the GPU; what remains is of the order of a millisecond), which puts a
  batch-1 decode step of ``llama3.1-8b-h100`` at 7.4 ms;
* ``activation_reserve_bytes`` 3 GiB (8B) and 1.5 GiB (1B): the order of what vLLM's start-up
  profiling reserves for these models; ``memory_utilization`` 0.9: vLLM's default
  ``gpu_memory_utilization``; ``max_num_batched_tokens`` 8192 (H100, H200) and 2048 (A100):
  vLLM's online-server defaults by GPU memory; ``max_num_seqs`` 256: vLLM's default.

Measured on one H200 with PyTorch (``bench/accelerator_check.py``'s workload, bf16, CUDA
events, medians of 10): an 8192^3 matrix product ran at 778 TFLOP/s (0.79 of the 989.4 peak), a
4 GiB device copy at 4.29 TB/s read + written (0.89 of 4.8); the 8B's linear layers (replayed as
a CUDA graph) took 4.36 ms for one token (the weights streamed at 0.72 of peak bandwidth; the
model: 4.47 ms), 6.74 ms for 256 decode tokens (model 6.47 ms) and 41.9 ms for a 2048-token
prefill chunk (0.69 of peak FLOP/s; model 48.2 ms); causal prefill attention over 32 layers
reached 0.50 (4096 tokens) to 0.55 (8192) of peak FLOP/s, decode attention through PyTorch's
generic ``scaled_dot_product_attention`` (not a paged decode kernel) 0.45 of peak bandwidth.
Run the script on another GPU to recalibrate the fractions for it.

References: S. Williams, A. Waterman, D. Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 52(4), 2009.  A. Agrawal et al., "Vidur: A Large-Scale
Simulation Framework for LLM Inference", MLSys 2024.  T. Dao, "FlashAttention-2", 2023.
J. Shah et al., "FlashAttention-3", 2024.  NVIDIA H100, A100 and H200 datasheets.
"""

from __future__ import annotations

import difflib
import math
import operator
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "ModelShape",
    "Accelerator",
    "Profile",
    "StepWork",
    "StepCost",
    "ModeledClock",
    "FixedClock",
    "MIN_STEP_S",
    "MeasuredClock",
    "plain_number",
    "serving_clock",
    "MODELS",
    "ACCELERATORS",
    "PROFILES",
    "DEFAULT_PROFILE",
    "get_profile",
    "make_profile",
    "causal_pairs",
]

MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, not bool")
    try:
        v = int(operator.index(value))
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _float(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
           low_open: bool = True, high_open: bool = True) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    v = float(value)
    ok_low = v > low if low_open else v >= low
    ok_high = v < high if high_open else v <= high
    if not (ok_low and ok_high) or math.isnan(v):
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise ValueError(f"{name} must be in {lo}{low:g}, {high:g}{hi}, got {value!r}")
    return v


def _name(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"name must be a non-empty string, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------
# the model and the hardware
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer of the Llama shape: grouped-query attention (``heads`` query
    heads, ``kv_heads`` key/value heads of ``head_dim``), a gated MLP of ``intermediate`` (three
    matrices), ``vocab`` tokens, weights and K/V of ``dtype_bytes`` each."""

    name: str
    """The model's name in profile names (``llama3.1-8b``)."""
    layers: int
    """Transformer layers."""
    hidden: int
    """The hidden size."""
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    """Whether the LM head shares the embedding's weights."""
    max_model_len: int = 8192
    """The longest context the model serves, in tokens."""

    def __post_init__(self) -> None:
        _name(self.name)
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                  "dtype_bytes", "max_model_len"):
            object.__setattr__(self, f, _int(f, getattr(self, f), 1))
        if not isinstance(self.tied_embeddings, bool):
            raise TypeError(f"tied_embeddings must be a bool, not "
                            f"{type(self.tied_embeddings).__name__}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads}): each key/value head serves a group of query "
                             f"heads")

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's matrices: Q, K, V and output projections, and the MLP's gate,
        up and down matrices."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate

    @property
    def linear_params(self) -> int:
        """Weights one step multiplies by: every layer's matrices and the LM head."""
        return self.layers * self.layer_linear_params + self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All the parameters: the layers' matrices and norms, the final norm, the embedding
        and (untied) the LM head."""
        embeddings = self.vocab * self.hidden
        norms = (2 * self.layers + 1) * self.hidden
        return (self.layers * self.layer_linear_params + norms
                + embeddings * (1 if self.tied_embeddings else 2))

    @property
    def weight_bytes(self) -> int:
        """The weights' memory."""
        return self.params * self.dtype_bytes

    @property
    def step_weight_bytes(self) -> int:
        """The weights one step reads: :attr:`linear_params` (the embedding is a gather of a
        few rows and is left out)."""
        return self.linear_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Accelerator:
    """One GPU: ``peak_flops`` (dense, at the model's dtype), ``memory_bandwidth`` (bytes/s),
    ``memory_bytes`` (as the driver reports it), the achievable fractions of the two peaks and
    the fixed per-step overhead (seconds)."""

    name: str
    """The GPU's name in profile names (``h100``)."""
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: int
    compute_efficiency: float = 0.6
    """The fraction of ``peak_flops`` a step's kernels achieve."""
    bandwidth_efficiency: float = 0.7
    """The fraction of ``memory_bandwidth`` a step's kernels achieve."""
    step_overhead_s: float = 1e-3
    """The fixed CPU-side time of a step, in seconds."""

    def __post_init__(self) -> None:
        _name(self.name)
        object.__setattr__(self, "peak_flops", _float("peak_flops", self.peak_flops))
        object.__setattr__(self, "memory_bandwidth",
                           _float("memory_bandwidth", self.memory_bandwidth))
        object.__setattr__(self, "memory_bytes", _int("memory_bytes", self.memory_bytes, 1))
        for f in ("compute_efficiency", "bandwidth_efficiency"):
            object.__setattr__(self, f, _float(f, getattr(self, f), high=1.0, high_open=False))
        object.__setattr__(self, "step_overhead_s",
                           _float("step_overhead_s", self.step_overhead_s, low_open=False))

    @property
    def flops(self) -> float:
        """The achievable FLOP/s: peak times ``compute_efficiency``."""
        return self.peak_flops * self.compute_efficiency

    @property
    def bandwidth(self) -> float:
        """The achievable bytes/s: peak times ``bandwidth_efficiency``."""
        return self.memory_bandwidth * self.bandwidth_efficiency


@dataclass(frozen=True)
class Profile:
    """A model served on one accelerator, with the serving defaults that go with them (see the
    module docstring for every constant's source)."""

    name: str
    """The profile's name, ``MODEL-GPU``."""
    model: ModelShape
    accelerator: Accelerator
    activation_reserve_bytes: int
    """Memory set aside for activations, CUDA graphs and allocations outside the KV cache."""
    memory_utilization: float = 0.9
    """The share of the GPU's memory the server may use (vLLM's ``gpu_memory_utilization``)."""
    max_num_batched_tokens: int = 8192
    """The step budget that goes with the GPU (vLLM's default for it)."""
    max_num_seqs: int = 256
    """Sequences one step runs at most (vLLM's default)."""

    def __post_init__(self) -> None:
        _name(self.name)
        if not isinstance(self.model, ModelShape):
            raise TypeError(f"model must be a ModelShape, not {type(self.model).__name__}")
        if not isinstance(self.accelerator, Accelerator):
            raise TypeError(f"accelerator must be an Accelerator, not "
                            f"{type(self.accelerator).__name__}")
        object.__setattr__(self, "activation_reserve_bytes",
                           _int("activation_reserve_bytes", self.activation_reserve_bytes, 0))
        object.__setattr__(self, "memory_utilization",
                           _float("memory_utilization", self.memory_utilization, high=1.0,
                                  high_open=False))
        for f in ("max_num_batched_tokens", "max_num_seqs"):
            object.__setattr__(self, f, _int(f, getattr(self, f), 1))

    def kv_budget_bytes(self, memory_utilization: Optional[float] = None) -> int:
        """Memory left for the KV cache: ``memory_bytes x memory_utilization - weights -
        activation reserve`` (may be negative: the model does not fit)."""
        util = (self.memory_utilization if memory_utilization is None
                else _float("memory_utilization", memory_utilization, high=1.0,
                            high_open=False))
        usable = int(self.accelerator.memory_bytes * util)
        return usable - self.model.weight_bytes - self.activation_reserve_bytes

    def page_bytes(self, page_tokens: int = 16) -> int:
        """Bytes of one KV page of ``page_tokens`` tokens."""
        return _int("page_tokens", page_tokens, 1) * self.model.kv_bytes_per_token

    def kv_pages(self, page_tokens: int = 16, memory_utilization: Optional[float] = None) -> int:
        """The KV pool in pages of ``page_tokens`` tokens: :meth:`kv_budget_bytes` divided by
        :meth:`page_bytes`, rounded down.  Raises ``ValueError`` when not one page fits."""
        page = self.page_bytes(page_tokens)
        budget = self.kv_budget_bytes(memory_utilization)
        pages = budget // page if budget > 0 else 0
        if pages < 1:
            acc = self.accelerator
            util = self.memory_utilization if memory_utilization is None else memory_utilization
            raise ValueError(
                f"profile {self.name}: no memory for the KV cache: {acc.name} has "
                f"{acc.memory_bytes / GiB:.2f} GiB, x memory_utilization {util:g} leaves "
                f"{acc.memory_bytes * float(util) / GiB:.2f} GiB; the weights take "
                f"{self.model.weight_bytes / GiB:.2f} GiB and the activation reserve "
                f"{self.activation_reserve_bytes / GiB:.2f} GiB, and a page of {page_tokens} "
                f"tokens needs {page / MiB:.2f} MiB")
        return int(pages)

    def kv_tokens(self, page_tokens: int = 16, memory_utilization: Optional[float] = None) -> int:
        """Tokens the KV pool holds: :meth:`kv_pages` times ``page_tokens``."""
        return self.kv_pages(page_tokens, memory_utilization) * int(page_tokens)


# --------------------------------------------------------------------------------------------
# the named profiles
# --------------------------------------------------------------------------------------------

#: Model shapes by name (their published ``config.json`` values).
#:
#: :meta hide-value:
MODELS: Dict[str, ModelShape] = {
    "llama3.1-8b": ModelShape("llama3.1-8b", layers=32, hidden=4096, heads=32, kv_heads=8,
                              head_dim=128, intermediate=14336, vocab=128256, dtype_bytes=2,
                              tied_embeddings=False, max_model_len=131072),
    "llama3.2-1b": ModelShape("llama3.2-1b", layers=16, hidden=2048, heads=32, kv_heads=8,
                              head_dim=64, intermediate=8192, vocab=128256, dtype_bytes=2,
                              tied_embeddings=True, max_model_len=131072),
}

#: Accelerators by name (NVIDIA's datasheets; the memory the driver reports).
#:
#: :meta hide-value:
ACCELERATORS: Dict[str, Accelerator] = {
    "h100": Accelerator("H100 SXM 80GB", peak_flops=989.4e12, memory_bandwidth=3.35e12,
                        memory_bytes=81559 * MiB),
    "a100": Accelerator("A100 SXM 80GB", peak_flops=312e12, memory_bandwidth=2.039e12,
                        memory_bytes=81920 * MiB),
    "h200": Accelerator("H200 SXM 141GB", peak_flops=989.4e12, memory_bandwidth=4.8e12,
                        memory_bytes=143771 * MiB),
}

_RESERVE = {"llama3.1-8b": 3 * GiB, "llama3.2-1b": 3 * GiB // 2}
#: vLLM's online-server max_num_batched_tokens: 8192 on GPUs of 70 GiB or more but A100s, else
#: 2048.
_BATCHED = {"h100": 8192, "h200": 8192, "a100": 2048}


def _lookup(kind: str, name: str, table: Dict[str, Any]) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key in table:
        return key
    close = difflib.get_close_matches(str(key), list(table), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"unknown {kind} {name!r}{hint} (the {kind}s: {', '.join(table)})")


def make_profile(model: Union[str, ModelShape], accelerator: Union[str, Accelerator], *,
                 name: Optional[str] = None, activation_reserve_bytes: Optional[int] = None,
                 **serving: Any) -> Profile:
    """A :class:`Profile` of ``model`` (a :data:`MODELS` name or a :class:`ModelShape`) on
    ``accelerator`` (an :data:`ACCELERATORS` name or an :class:`Accelerator`).  Defaults: the
    named model's activation reserve (else 2 GiB per 8 GB of weights, at least 1 GiB), the named
    GPU's ``max_num_batched_tokens`` (else 8192); ``serving`` sets ``memory_utilization``,
    ``max_num_batched_tokens``, ``max_num_seqs``."""
    m = MODELS[_lookup("model", model, MODELS)] if isinstance(model, str) else model
    a = (ACCELERATORS[_lookup("accelerator", accelerator, ACCELERATORS)]
         if isinstance(accelerator, str) else accelerator)
    if not isinstance(m, ModelShape):
        raise TypeError(f"model must be a name or a ModelShape, not {type(m).__name__}")
    if not isinstance(a, Accelerator):
        raise TypeError(f"accelerator must be a name or an Accelerator, not {type(a).__name__}")
    gpu_key = next((k for k, v in ACCELERATORS.items() if v is a), None)
    if activation_reserve_bytes is None:
        activation_reserve_bytes = _RESERVE.get(
            m.name, max(GiB, 2 * GiB * m.weight_bytes // (8 * 10**9)))
    serving.setdefault("max_num_batched_tokens", _BATCHED.get(gpu_key or "", 8192))
    if name is None:
        name = f"{m.name}-{gpu_key}" if gpu_key is not None else f"{m.name}-{a.name}"
    return Profile(name, m, a, activation_reserve_bytes, **serving)


#: Every named profile: each model of :data:`MODELS` on each GPU of :data:`ACCELERATORS`.
#:
#: :meta hide-value:
PROFILES: Dict[str, Profile] = {
    f"{m}-{a}": make_profile(m, a) for m in MODELS for a in ACCELERATORS
}

#: The profile the simulator uses by default: an 8B Llama on one H100.
DEFAULT_PROFILE = "llama3.1-8b-h100"


def get_profile(profile: Union[str, Profile] = DEFAULT_PROFILE) -> Profile:
    """The :class:`Profile` named ``profile`` (case and surrounding spaces ignored), or
    ``profile`` itself.  An unknown name raises ``ValueError`` naming the close matches."""
    if isinstance(profile, Profile):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a name or a Profile, not {type(profile).__name__}")
    return PROFILES[_lookup("profile", profile, PROFILES)]


# --------------------------------------------------------------------------------------------
# a step's work and its cost
# --------------------------------------------------------------------------------------------


def causal_pairs(query_len: int, seq_len: int) -> int:
    """(query, key) pairs of causal attention for ``query_len`` new tokens at the end of a
    context of ``seq_len`` tokens: the ``j``-th new token attends to ``seq_len - query_len + j
    + 1`` keys."""
    q, s = int(query_len), int(seq_len)
    return q * (s - q) + q * (q + 1) // 2


@dataclass(frozen=True)
class StepWork:
    """What one step computes: ``num_seqs`` sequences, ``prefill_tokens + decode_tokens`` tokens
    through the linear layers, ``context_tokens`` (the sum of ``seq_lens``: K/V read by
    attention), ``attention_pairs`` causal (query, key) pairs, ``sampled_tokens`` rows through
    the LM head and ``copied_pages`` copy-on-write copies of ``page_tokens``-token pages.  The
    prefill/decode split is informative: the cost depends on the tokens, not on their kind."""

    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int
    attention_pairs: int
    sampled_tokens: int
    copied_pages: int = 0
    page_tokens: int = 16

    def __post_init__(self) -> None:
        for f in ("num_seqs", "prefill_tokens", "decode_tokens", "context_tokens",
                  "attention_pairs", "sampled_tokens", "copied_pages"):
            object.__setattr__(self, f, _int(f, getattr(self, f), 0))
        object.__setattr__(self, "page_tokens", _int("page_tokens", self.page_tokens, 1))
        t = self.tokens
        if t and not self.num_seqs:
            raise ValueError(f"{t} tokens in a step of no sequence")
        if self.context_tokens < t:
            raise ValueError(f"context_tokens ({self.context_tokens}) must be at least the "
                             f"step's tokens ({t}): every computed token is in its context")
        if self.attention_pairs < t:
            raise ValueError(f"attention_pairs ({self.attention_pairs}) must be at least the "
                             f"step's tokens ({t}): every token attends to itself")

    @property
    def tokens(self) -> int:
        """Tokens through the linear layers."""
        return self.prefill_tokens + self.decode_tokens

    @classmethod
    def from_lens(cls, query_lens: ArrayLike, seq_lens: ArrayLike, *,
                  sampled_tokens: Optional[int] = None, prefill_tokens: Optional[int] = None,
                  copied_pages: int = 0, page_tokens: int = 16) -> "StepWork":
        """The work of sequences computing ``query_lens[i]`` tokens that end a context of
        ``seq_lens[i]`` tokens.  ``sampled_tokens`` defaults to one per sequence;
        ``prefill_tokens`` to the tokens of the sequences computing more than one."""
        q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        if len(q) != len(s):
            raise ValueError(f"query_lens and seq_lens differ in length ({len(q)} and {len(s)})")
        if len(q) and (q.min() < 0 or (s < q).any()):
            raise ValueError("every query length must be >= 0 and at most its seq_len")
        total = int(q.sum())
        pairs = int((q * (s - q) + q * (q + 1) // 2).sum())
        prefill = int(q[q > 1].sum()) if prefill_tokens is None else prefill_tokens
        decode = total - _int("prefill_tokens", prefill, 0)
        if decode < 0:
            raise ValueError(f"prefill_tokens ({prefill}) exceeds the step's {total} tokens")
        return cls(num_seqs=len(q), prefill_tokens=prefill, decode_tokens=decode,
                   context_tokens=int(s.sum()), attention_pairs=pairs,
                   sampled_tokens=len(q) if sampled_tokens is None else sampled_tokens,
                   copied_pages=copied_pages, page_tokens=page_tokens)

    @classmethod
    def from_plan(cls, plan: Any) -> "StepWork":
        """The work of a scheduler's step plan (``qualia.StepPlan`` or the twin's): its query
        lengths (``query_start_loc``), ``seq_lens``, sampled rows (``logits_indices``),
        ``copies``, and its prefill/decode split (``num_prefill_tokens``,
        ``num_decode_tokens``)."""
        qsl = np.asarray(plan.query_start_loc, dtype=np.int64)
        query = qsl[1:] - qsl[:-1]
        prefill = int(plan.num_prefill_tokens)
        total = int(qsl[-1] - qsl[0]) if len(qsl) else 0
        if prefill + int(plan.num_decode_tokens) != total:
            raise ValueError(f"the plan's num_prefill_tokens + num_decode_tokens "
                             f"({prefill} + {int(plan.num_decode_tokens)}) differ from its "
                             f"query_start_loc ({total} tokens)")
        return cls.from_lens(query, plan.seq_lens, sampled_tokens=len(plan.logits_indices),
                             prefill_tokens=prefill, copied_pages=len(plan.copies),
                             page_tokens=int(getattr(plan, "page_tokens", 16)))


@dataclass(frozen=True)
class StepCost:
    """One step's modeled time, by part (seconds).  Each GPU part's time is the larger of its
    compute and memory times; :attr:`seconds` adds the parts."""

    overhead_s: float
    """The fixed CPU-side overhead."""
    linear_compute_s: float
    """The linear layers' FLOPs at the achievable FLOP/s."""
    linear_memory_s: float
    """The weights read at the achievable bandwidth."""
    attention_compute_s: float
    """Attention's FLOPs at the achievable FLOP/s."""
    attention_memory_s: float
    """The K/V read and written at the achievable bandwidth."""
    copy_s: float
    """The copy-on-write page copies at the achievable bandwidth."""

    @property
    def linear_s(self) -> float:
        """The linear layers' time: the larger of their compute and memory times."""
        return max(self.linear_compute_s, self.linear_memory_s)

    @property
    def attention_s(self) -> float:
        """Attention's time: the larger of its compute and memory times."""
        return max(self.attention_compute_s, self.attention_memory_s)

    @property
    def seconds(self) -> float:
        """The step's time: overhead + linear layers + attention + copies."""
        return self.overhead_s + self.linear_s + self.attention_s + self.copy_s

    @property
    def linear_bound(self) -> str:
        """``"compute"`` or ``"memory"``: what limits the linear layers (``"memory"`` on a
        tie)."""
        return "compute" if self.linear_compute_s > self.linear_memory_s else "memory"

    @property
    def attention_bound(self) -> str:
        """``"compute"`` or ``"memory"``: what limits attention (``"memory"`` on a tie)."""
        return "compute" if self.attention_compute_s > self.attention_memory_s else "memory"


class ModeledClock:
    """The modeled time of engine steps on ``profile`` (a :data:`PROFILES` name or a
    :class:`Profile`; see the module docstring for the model).  A serving clock (see
    :func:`serving_clock`): :meth:`step_time` is :meth:`plan_seconds`."""

    kind = "modeled"

    def __init__(self, profile: Union[str, Profile] = DEFAULT_PROFILE) -> None:
        self.profile = p = get_profile(profile)
        m, a = p.model, p.accelerator
        # the factors of cost(), multiplied in its order (step_time() gives its seconds bit
        # for bit)
        self._linear_per_token = 2.0 * m.layers * m.layer_linear_params
        self._head_per_row = 2.0 * m.vocab * m.hidden
        self._weights_s = float(m.step_weight_bytes) / a.bandwidth
        self._attention_per_pair = 4.0 * m.layers * m.heads * m.head_dim
        self._kv_bytes = float(m.kv_bytes_per_token)
        self._flops, self._bandwidth = a.flops, a.bandwidth
        self._overhead_s = a.step_overhead_s

    def __repr__(self) -> str:
        return f"ModeledClock({self.profile.name!r})"

    def describe(self) -> str:
        """One line naming the clock, for a run's summary."""
        p = self.profile
        return (f"modeled {p.model.name} on one {p.accelerator.name} (roofline: "
                f"{plain_number(p.accelerator.compute_efficiency)} of peak FLOP/s, "
                f"{plain_number(p.accelerator.bandwidth_efficiency)} of peak bandwidth, "
                f"{plain_number(p.accelerator.step_overhead_s * 1e3)} ms per step)")

    def cost(self, work: StepWork) -> StepCost:
        """The modeled time of a step doing ``work``, by part."""
        if not isinstance(work, StepWork):
            raise TypeError(f"work must be a StepWork, not {type(work).__name__}")
        m, a = self.profile.model, self.profile.accelerator
        flops, bw = a.flops, a.bandwidth
        t = work.tokens
        if t:
            linear_flops = (2.0 * m.layers * m.layer_linear_params * t
                            + 2.0 * m.vocab * m.hidden * work.sampled_tokens)
            linear_bytes = float(m.step_weight_bytes)
            attn_flops = 4.0 * m.layers * m.heads * m.head_dim * work.attention_pairs
            attn_bytes = float(m.kv_bytes_per_token) * (work.context_tokens + t)
        else:
            linear_flops = linear_bytes = attn_flops = attn_bytes = 0.0
        copy_bytes = 2.0 * work.copied_pages * work.page_tokens * m.kv_bytes_per_token
        return StepCost(overhead_s=a.step_overhead_s,
                        linear_compute_s=linear_flops / flops,
                        linear_memory_s=linear_bytes / bw,
                        attention_compute_s=attn_flops / flops,
                        attention_memory_s=attn_bytes / bw,
                        copy_s=copy_bytes / bw)

    def seconds(self, work: StepWork) -> float:
        """The modeled time of a step doing ``work``."""
        return self.cost(work).seconds

    def plan_seconds(self, plan: Any) -> float:
        """The modeled time of the step that computes ``plan``."""
        return self.seconds(StepWork.from_plan(plan))

    def step_time(self, plan: Any, measured_s: float) -> float:
        """The serving clock's time of the step that computed ``plan`` (or did a
        :class:`StepWork`): its modeled time (``measured_s``, the step's time on this machine,
        is not used).  The same seconds as :meth:`plan_seconds`, bit for bit; a plan is costed
        straight from its arrays (:meth:`work_seconds`), trusting its lengths (each query
        length at least 1 and at most its ``seq_len``, as every scheduler's plan has them),
        where :meth:`plan_seconds` checks every length first."""
        if isinstance(plan, StepWork):
            return self.seconds(plan)
        qsl = plan.query_start_loc
        n = len(qsl) - 1
        if n < 1:
            return self.plan_seconds(plan)
        if n < 64:  # a short plan: Python ints beat numpy's per-call cost
            ends, seqs = qsl.tolist(), plan.seq_lens.tolist()
            tokens, context, pairs, at = ends[n] - ends[0], sum(seqs), 0, ends[0]
            for end, seq in zip(ends[1:], seqs):
                q, at = end - at, end
                pairs += q * (seq - q) + q * (q + 1) // 2
        else:
            ends64 = qsl.astype(np.int64)
            q64 = ends64[1:] - ends64[:-1]
            seqs64 = plan.seq_lens.astype(np.int64)
            tokens, context = int(ends64[n] - ends64[0]), int(seqs64.sum())
            # the sum of q (s - q) + q (q + 1) / 2 = q s - (q^2 - q) / 2
            pairs = int(np.dot(q64, seqs64)) - (int(np.dot(q64, q64)) - tokens) // 2
        prefill, decode = int(plan.num_prefill_tokens), int(plan.num_decode_tokens)
        if prefill + decode != tokens:
            raise ValueError(f"the plan's num_prefill_tokens + num_decode_tokens "
                             f"({prefill} + {decode}) differ from its query_start_loc "
                             f"({tokens} tokens)")
        if not tokens:
            return self.plan_seconds(plan)
        if context < tokens:
            raise ValueError(f"context_tokens ({context}) must be at least the step's tokens "
                             f"({tokens}): every computed token is in its context")
        copied = len(plan.copies)
        return self.work_seconds(tokens, context, pairs, len(plan.logits_indices), copied,
                                 int(getattr(plan, "page_tokens", 16)) if copied else 16)

    def work_seconds(self, tokens: int, context: int, pairs: int, rows: int, copied: int = 0,
                     page_tokens: int = 16) -> float:
        """The modeled time of a step of ``tokens`` tokens (at least 1) whose sequences'
        ``seq_lens`` add up to ``context``, with ``pairs`` causal attention pairs (a decode
        step: ``context``), ``rows`` sampled rows and ``copied`` copy-on-write copies of
        ``page_tokens``-token pages: :meth:`seconds` of that :class:`StepWork`, bit for bit,
        in O(1) and unchecked (a caller that keeps the context sum from step to step costs a
        decode step without reading its arrays)."""
        # cost() of the StepWork, multiplied in its order
        flops, bw = self._flops, self._bandwidth
        linear = (self._linear_per_token * tokens + self._head_per_row * rows) / flops
        weights = self._weights_s
        attention = self._attention_per_pair * pairs / flops
        kv = self._kv_bytes * (context + tokens) / bw
        seconds = (self._overhead_s + (linear if linear >= weights else weights)
                   + (attention if attention >= kv else kv))
        if copied:
            seconds += 2.0 * copied * page_tokens * self.profile.model.kv_bytes_per_token / bw
        return seconds


# --------------------------------------------------------------------------------------------
# the other serving clocks
# --------------------------------------------------------------------------------------------


def plain_number(x: float, digits: int = 12) -> str:
    """``x`` to ``digits`` significant digits, with thousands separators and never in
    scientific notation, trailing zeros dropped: ``3600000.0`` is ``3,600,000``, ``1e-12`` is
    ``0.000000000001``."""
    text = np.format_float_positional(float(x), precision=digits, unique=False,
                                      fractional=False, trim="-")
    whole, point, fraction = text.partition(".")
    sign = "-" if whole.startswith("-") else ""
    return f"{sign}{int(whole.lstrip('-')):,}{point}{fraction}"


#: The shortest fixed step, in seconds (a microsecond): a workload's or a trace's arrivals come
#: up to 1e9 s, where a float second count moves by about 0.12 microseconds, so a shorter step
#: would leave a serving clock near the latest arrival where it is (or move it by a rounding).
MIN_STEP_S = 1e-6


class FixedClock:
    """A serving clock that charges every step the same ``seconds`` (``simulate --step-ms``):
    reproducible, and blind to what a step computes.  ``seconds``: a finite number of at least
    :data:`MIN_STEP_S` (a microsecond), so that each step moves the clock up to the latest
    arrival a run may have."""

    kind = "fixed"

    def __init__(self, seconds: float) -> None:
        self.seconds = _float("seconds", seconds, low=MIN_STEP_S, low_open=False)

    def __repr__(self) -> str:
        return f"FixedClock({self.seconds!r})"

    def describe(self) -> str:
        """One line naming the clock, for a run's summary."""
        return f"fixed: {plain_number(self.seconds * 1e3)} ms per step"

    def step_time(self, plan: Any, measured_s: float) -> float:
        """``seconds``, whatever the step computed."""
        return self.seconds


class MeasuredClock:
    """A serving clock that charges every step its measured time on this machine: the
    scheduler's calls and the backend's ``execute_step`` (no GPU: a C hash backend's step
    takes microseconds), so the figures vary from run to run and say nothing about serving a
    model."""

    kind = "measured"

    def __repr__(self) -> str:
        return "MeasuredClock()"

    def describe(self) -> str:
        """One line naming the clock, for a run's summary."""
        return "measured: each step's time on this machine's CPU (no GPU is modeled)"

    def step_time(self, plan: Any, measured_s: float) -> float:
        """``measured_s``, the step's time on this machine."""
        return float(measured_s)


def serving_clock(clock: Any = None) -> Any:
    """A serving clock: an object with ``kind``, ``describe()`` and ``step_time(plan,
    measured_s)`` (the seconds the step that computed ``plan``, or did a :class:`StepWork`,
    advances the clock by; ``measured_s`` is the step's time on this machine).  ``clock``: None (a
    :class:`ModeledClock` on :data:`DEFAULT_PROFILE`), ``"measured"`` (a
    :class:`MeasuredClock`), a profile name or :class:`Profile` (a :class:`ModeledClock` on
    it), a number of seconds per step (a :class:`FixedClock`), or a serving clock, returned as
    it is."""
    if clock is None:
        return ModeledClock(DEFAULT_PROFILE)
    if isinstance(clock, str) and clock.strip().lower() == "measured":
        return MeasuredClock()
    if isinstance(clock, (str, Profile)):
        return ModeledClock(clock)
    if isinstance(clock, (int, float, np.number)) and not isinstance(clock, (bool, np.bool_)):
        return FixedClock(float(clock))
    if callable(getattr(clock, "step_time", None)) and callable(getattr(clock, "describe", None)):
        return clock
    raise TypeError(f"clock must be None, 'measured', a profile, a number of seconds or a "
                    f"serving clock (step_time and describe), not {type(clock).__name__}")
