"""A nano-vllm-shaped engine step, written here as a CPU baseline for bench/trace_bench.py.

The shape follows nano-vllm's engine (its ``Sequence``, ``BlockManager``, ``Scheduler``, the
model runner's input preparation and ``LLMEngine.step``); the code is this repository's own:

* ``Sequence``: the token list (prompt then generated tokens), the block table, counts of
  prompt, total and cached tokens, the last token, ``max_tokens`` and ``ignore_eos``.
* ``BlockManager``: a deque of free block ids, a ref count per block, and prefix caching of
  full blocks by a hash chained over the blocks before (each block's key hashes the previous
  block's key and its token ids).  The hash is xxhash's xxh64 when the ``xxhash`` module is
  installed (nano-vllm's choice), else ``hashlib.blake2b`` with an 8-byte digest;
  ``HASH_NAME`` says which one this interpreter uses.
* ``Scheduler``: waiting and running deques; a step is either all prefills (whole prompts,
  admitted in order while ``max_num_seqs`` and ``max_num_batched_tokens`` allow and the pool has
  the blocks) or all decodes; a decode that cannot get a block preempts the newest running
  sequence (its blocks freed, back to the front of the waiting queue, recomputed later).
* ``prepare_prefill`` / ``prepare_decode``: the model's inputs built as Python lists, then
  turned into numpy arrays (nano-vllm builds torch tensors and copies them to the GPU; numpy is
  the CPU stand-in here).
* ``postprocess``: append the sampled token, finish on EOS (unless ignored) or ``max_tokens``.

The model and sampler are a fake: the next token is ``fake_tokens(seq_ids, positions,
token_ids)``, the same function of (request id, position, input token) as qualia's hash
backend, so the baseline's outputs can be compared token for token with qualia's.  The engine
times the fake separately (``Engine.fake_seconds``) so a benchmark can leave it out.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque

import numpy as np

try:  # pragma: no cover - which branch runs depends on the environment
    import xxhash

    HASH_NAME = "xxh64"

    def _block_key(prev, token_ids):
        h = xxhash.xxh64()
        if prev != -1:
            h.update(prev.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return h.intdigest()

except ImportError:
    HASH_NAME = "blake2b-64"

    def _block_key(prev, token_ids):
        h = hashlib.blake2b(digest_size=8)
        if prev != -1:
            h.update(prev.to_bytes(8, "little"))
        h.update(np.array(token_ids).tobytes())
        return int.from_bytes(h.digest(), "little")


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_LO = np.uint64(0xFFFFFFFF)


def fake_tokens(request_ids, positions, token_ids, vocab=32000):
    """The next token of each row, vectorized: the splitmix-style mix of (request id, position,
    input token) reduced to [0, vocab) by a multiply-high, bit for bit what qualia's hash
    backend (``qualia.hash_next_token``) computes.  Returns a uint32 array."""
    r = np.asarray(request_ids, dtype=np.uint64)
    p = np.asarray(positions).astype(np.uint64)
    t = np.asarray(token_ids).astype(np.uint64)
    with np.errstate(over="ignore"):
        x = r * _K1 + p * _K2 + t
        x ^= x >> _S30
        x *= _K2
        x ^= x >> _S27
        x *= _K3
        x ^= x >> _S31
        v = np.uint64(vocab)
        # (x * vocab) >> 64 with vocab < 2**32, from two 32x32-bit products
        hi = (x >> _S32) * v
        lo = (x & _LO) * v
        out = (hi + (lo >> _S32)) >> _S32
    return out.astype(np.uint32)


WAITING, RUNNING, FINISHED = 0, 1, 2


class Sequence:
    """One request: its tokens, its blocks and its stop conditions."""

    __slots__ = ("seq_id", "status", "token_ids", "last_token", "num_tokens",
                 "num_prompt_tokens", "num_cached_tokens", "block_table", "max_tokens",
                 "ignore_eos", "block_size")

    def __init__(self, seq_id, token_ids, max_tokens, block_size, ignore_eos=False):
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.seq_id = seq_id
        self.status = WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.block_table = []
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.block_size = block_size

    def __len__(self):
        return self.num_tokens

    @property
    def num_completion_tokens(self):
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self):
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self):
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_cached_blocks(self):
        return self.num_cached_tokens // self.block_size

    @property
    def last_block_num_tokens(self):
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i):
        bs = self.block_size
        return self.token_ids[i * bs:(i + 1) * bs]

    def append_token(self, token_id):
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1


class BlockManager:
    """Free-block deque, ref counts, and the chained-hash index of full blocks."""

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_key = [-1] * num_blocks       # the chained hash of a full block, else -1
        self.block_tokens = [None] * num_blocks  # a full block's tokens, checked on a hit
        self.key_to_block = {}
        self.free_block_ids = deque(range(num_blocks))
        self.used_block_ids = set()

    def _take(self, block_id):
        # the block leaves the free deque (a cached block can sit anywhere in it)
        self.ref_count[block_id] = 1
        self.block_key[block_id] = -1
        self.block_tokens[block_id] = None
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)

    def _give_back(self, block_id):
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq):
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq):
        bs = self.block_size
        prev = -1
        miss = False
        for i in range(seq.num_blocks):
            tokens = seq.block(i)
            key = _block_key(prev, tokens) if len(tokens) == bs else -1
            block_id = self.key_to_block.get(key, -1)
            # a hit must leave at least the prompt's last token to compute
            if (block_id == -1 or self.block_tokens[block_id] != tokens
                    or (i + 1) * bs >= seq.num_tokens):
                miss = True
            if miss:
                block_id = self.free_block_ids[0]
                self._take(block_id)
            else:
                seq.num_cached_tokens += bs
                if block_id in self.used_block_ids:
                    self.ref_count[block_id] += 1
                else:
                    self._take(block_id)
            if key != -1:
                self.block_key[block_id] = key
                self.block_tokens[block_id] = tokens
                self.key_to_block[key] = block_id
            seq.block_table.append(block_id)
            prev = key

    def deallocate(self, seq):
        for block_id in reversed(seq.block_table):
            self.ref_count[block_id] -= 1
            if self.ref_count[block_id] == 0:
                self._give_back(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq):
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq):
        bs = self.block_size
        table = seq.block_table
        rem = len(seq) % bs
        if rem == 1:
            # the token to compute opens a new block
            block_id = self.free_block_ids[0]
            self._take(block_id)
            table.append(block_id)
        elif rem == 0:
            # the token to compute fills the last block: index it
            last = table[-1]
            tokens = seq.block(seq.num_blocks - 1)
            prev = self.block_key[table[-2]] if len(table) > 1 else -1
            key = _block_key(prev, tokens)
            self.block_key[last] = key
            self.block_tokens[last] = tokens
            self.key_to_block[key] = last


class Scheduler:
    """Prefill-first scheduling over waiting and running deques."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_num_batched_tokens, eos):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos = eos
        self.block_manager = BlockManager(num_blocks, block_size)
        self.waiting = deque()
        self.running = deque()
        self.num_preempted = 0

    def is_finished(self):
        return not self.waiting and not self.running

    def add(self, seq):
        self.waiting.append(seq)

    def schedule(self):
        bm = self.block_manager
        scheduled = []
        num_seqs = 0
        num_batched = 0
        while self.waiting and num_seqs < self.max_num_seqs:
            seq = self.waiting[0]
            if (num_batched + len(seq) > self.max_num_batched_tokens
                    or not bm.can_allocate(seq)):
                break
            num_seqs += 1
            bm.allocate(seq)
            num_batched += len(seq) - seq.num_cached_tokens
            seq.status = RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True
        while self.running and num_seqs < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                num_seqs += 1
                bm.may_append(seq)
                scheduled.append(seq)
        if not scheduled:
            raise RuntimeError("nothing to schedule: a waiting prompt does not fit the pool or "
                               "the batched-token budget")
        self.running.extendleft(reversed(scheduled))
        return scheduled, False

    def preempt(self, seq):
        seq.status = WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def postprocess(self, seqs, token_ids):
        for seq, token_id in zip(seqs, token_ids):
            seq.append_token(token_id)
            if ((not seq.ignore_eos and token_id == self.eos)
                    or seq.num_completion_tokens == seq.max_tokens):
                seq.status = FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)


class ModelRunner:
    """The model runner's input preparation; the model itself is ``fake_tokens``."""

    def __init__(self, block_size, vocab):
        self.block_size = block_size
        self.vocab = vocab

    def prepare_block_tables(self, seqs):
        width = max(len(seq.block_table) for seq in seqs)
        rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
        return np.array(rows, dtype=np.int32)

    def prepare_prefill(self, seqs):
        bs = self.block_size
        input_ids, positions = [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        max_seqlen_q = max_seqlen_k = 0
        slot_mapping = []
        for seq in seqs:
            seqlen = len(seq)
            start = seq.num_cached_tokens
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, seqlen))
            seqlen_q = seqlen - start
            cu_seqlens_q.append(cu_seqlens_q[-1] + seqlen_q)
            cu_seqlens_k.append(cu_seqlens_k[-1] + seqlen)
            max_seqlen_q = max(seqlen_q, max_seqlen_q)
            max_seqlen_k = max(seqlen, max_seqlen_k)
            for i in range(seq.num_cached_blocks, seq.num_blocks):
                first = seq.block_table[i] * bs
                if i != seq.num_blocks - 1:
                    last = first + bs
                else:
                    last = first + seq.last_block_num_tokens
                slot_mapping.extend(range(first, last))
        block_tables = None
        if cu_seqlens_k[-1] > cu_seqlens_q[-1]:  # a cached prefix: attention reads the blocks
            block_tables = self.prepare_block_tables(seqs)
        return {
            "input_ids": np.array(input_ids, dtype=np.int64),
            "positions": np.array(positions, dtype=np.int64),
            "cu_seqlens_q": np.array(cu_seqlens_q, dtype=np.int32),
            "cu_seqlens_k": np.array(cu_seqlens_k, dtype=np.int32),
            "max_seqlen_q": max_seqlen_q,
            "max_seqlen_k": max_seqlen_k,
            "slot_mapping": np.array(slot_mapping, dtype=np.int32),
            "block_tables": block_tables,
        }

    def prepare_decode(self, seqs):
        bs = self.block_size
        input_ids, positions, slot_mapping, context_lens = [], [], [], []
        for seq in seqs:
            input_ids.append(seq.last_token)
            positions.append(len(seq) - 1)
            context_lens.append(len(seq))
            slot_mapping.append(seq.block_table[-1] * bs + seq.last_block_num_tokens - 1)
        return {
            "input_ids": np.array(input_ids, dtype=np.int64),
            "positions": np.array(positions, dtype=np.int64),
            "slot_mapping": np.array(slot_mapping, dtype=np.int32),
            "context_lens": np.array(context_lens, dtype=np.int32),
            "block_tables": self.prepare_block_tables(seqs),
        }

    def run(self, seqs, is_prefill):
        """Prepare the inputs, run the fake model on the rows it samples; returns
        (token ids as a list, seconds spent in the fake)."""
        inputs = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        t0 = time.process_time()
        ids = np.array([seq.seq_id for seq in seqs], dtype=np.uint64)
        if is_prefill:
            last = inputs["cu_seqlens_q"][1:] - 1
            pos, tok = inputs["positions"][last], inputs["input_ids"][last]
        else:
            pos, tok = inputs["positions"], inputs["input_ids"]
        out = fake_tokens(ids, pos, tok, self.vocab).tolist()
        return out, time.process_time() - t0


class Engine:
    """``add_request`` / ``step`` / ``is_finished`` in nano-vllm's ``LLMEngine`` shape."""

    def __init__(self, num_blocks, block_size, *, max_num_seqs=512,
                 max_num_batched_tokens=16384, eos=-1, vocab=32000):
        self.block_size = block_size
        self.scheduler = Scheduler(num_blocks, block_size, max_num_seqs, max_num_batched_tokens,
                                   eos)
        self.model_runner = ModelRunner(block_size, vocab)
        self.fake_seconds = 0.0
        self.steps = 0

    def add_request(self, seq_id, prompt_token_ids, max_tokens, ignore_eos=False):
        self.scheduler.add(Sequence(seq_id, prompt_token_ids, max_tokens, self.block_size,
                                    ignore_eos))

    def step(self):
        seqs, is_prefill = self.scheduler.schedule()
        token_ids, fake = self.model_runner.run(seqs, is_prefill)
        self.fake_seconds += fake
        self.scheduler.postprocess(seqs, token_ids)
        self.steps += 1
        return [(seq.seq_id, seq.completion_token_ids) for seq in seqs
                if seq.status == FINISHED]

    def is_finished(self):
        return self.scheduler.is_finished()

    def run(self):
        """Step until every request finished; returns {seq_id: generated tokens}."""
        out = {}
        while not self.is_finished():
            for seq_id, tokens in self.step():
                out[seq_id] = tokens
        return out
