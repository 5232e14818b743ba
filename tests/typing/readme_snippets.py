"""The Python snippets of README.md, word for word, with what they need around them.

.ci/run type-checks this file with mypy against the installed package (so the README's own
`except qualia.SchedulerError.Prefix` must type-check), and tests/docs/test_readme.py runs it and
checks that every snippet of README.md is here unchanged.
"""

# ruff: noqa: B018, E402, F811, I001

# -- README "The engine step: add_request / schedule / update" ------------------------
import numpy as np
import qualia

scheduler = qualia.StepScheduler(num_pages=1024, page_tokens=16, logical_pages=64,
                                 max_num_seqs=16, max_num_batched_tokens=512,
                                 max_prefill_chunk=256)
header = np.arange(1000, 1400, dtype=np.uint32)  # a 400-token system prompt
for rid in range(8):
    ids = np.concatenate([header, np.array([rid, 7, 8], dtype=np.uint32)])
    scheduler.add_request(rid, ids, max_new_tokens=16)

backend = qualia.HashBackend()  # stands in for a model: see "Backends"
while scheduler.has_unfinished():
    plan = scheduler.schedule()  # input_ids, positions, slot_mapping, block_table, kv_indptr, ...
    sampled = backend.execute_step(plan)  # one forward over the mixed batch
    for done in scheduler.update(sampled):  # stop conditions applied; pages go to the cache
        assert isinstance(done, qualia.FinishedRequest)  # a FinishedGroup for n > 1
        print(done.request_id, done.finish_reason, done.output_tokens[:4])

for rid in range(8, 16):
    scheduler.add_request(rid, np.arange(rid, rid + 40, dtype=np.uint32), max_new_tokens=16)
result = scheduler.run(backend)  # the whole loop in C without the GIL (a C backend)
print(len(result.finished), result.totals["num_tokens"], scheduler.cache_stats().hit_tokens)

# -- README "The engine step": parallel sampling and beam search -----------------
import numpy as np
import qualia

scheduler = qualia.StepScheduler(num_pages=256, page_tokens=16, logical_pages=16, max_num_seqs=8)
question = np.arange(1, 41, dtype=np.uint32)  # 40 tokens: 2 full pages and a partial one
scheduler.add_request(1, question, max_new_tokens=8, n=4)  # 4 samples of one prefill
scheduler.add_request(2, question, max_new_tokens=8, beam_width=3)  # beam search of width 3
backend = qualia.HashBackend()
copied = 0
while scheduler.has_unfinished():
    plan = scheduler.schedule()
    # plan.fork_child_ids / fork_parent_ids: the forks since the last plan (a backend copies
    # its per-request state to each child); plan.copies: pages a child'scheduler first write copies
    copied += len(plan.copies)
    if plan.num_topk:  # beam rows: each row'scheduler num_topk best next tokens, with log-probs
        ids, topk_ids, topk_logprobs = backend.execute_step_topk(plan)
        finished = scheduler.update(ids, topk_ids, topk_logprobs)
    else:
        finished = scheduler.update(backend.execute_step(plan))
    for group in finished:
        assert isinstance(group, qualia.FinishedGroup)
        print(group.request_id, len(group.outputs), group.finish_reasons, group.scores)
print(scheduler.forks, "forks,", copied, "pages copied")

# -- README "The facade: admit / decode / finish" ------------------------------------------------

import qualia

s = qualia.Scheduler(max_requests=64, num_pages=4096, page_tokens=16, logical_pages=256)
backend = qualia.HashBackend()          # or your model: see "Backends"

system = list(range(1000, 1040))             # a shared system prompt
prompt = system + [5, 6, 7]
adm = s.admit(1, prompt, namespace=b"tenant-a")  # reuses the longest cached run of full pages
new = len(prompt) - adm.prefix_tokens        # on a hit, only the rest needs prefill
copies = s.reserve(1, new)                   # pages for the prompt; copies to perform first
# ... the model writes the K/V of the new tokens into s.block_table(1) ...
s.advance(1, new)                            # full pages are cached as they fill
s.complete_prefill(1, first_token=42)

receipt, outputs = s.decode(backend)         # one backend call for every decoding request
print(receipt.batch_size, outputs["next_token_id"])
s.finish(1)                                  # completion and cancellation alike
print(s.cache_stats().cached_pages, s.drain_events()["kind"])  # 2 pages stored, 2 events

# -- README "The seed's types": an admission whose shared prefix (two pages) does not fit the
# request's table (one logical page), so the store's attach fails with TableError.OutOfRange.

pool = qualia.BlockPool(8)
store = qualia.PrefixKvStore(2, 4)
sched = qualia.RequestScheduler(2, 1)
identity = qualia.PrefixIdentity.of_tokens([1, 2, 3, 4, 5], b"tenant-a")
store.publish(identity, [pool.allocate(), pool.allocate()], 5, pool)

try:
    sched.admit_with_prefix(7, identity, store, pool)
except qualia.SchedulerError.Prefix as err:
    err.chain   # ('SchedulerError.Prefix', 'PrefixKvError.Table', 'TableError.OutOfRange')

assert sched.active_count() == 0  # the admission failed, and changed nothing

# -- README "Backends" ---------------------------------------------------------------------------

import qualia


class GreedyBackend:
    """Next token = (token + position) % vocab; a stand-in for a real model."""

    def __init__(self, vocab=32000):
        self.vocab = vocab

    def execute_ragged(self, items, block_table, outputs):
        n = len(items)
        outputs["request_id"] = items["request_id"]
        outputs["slot"] = items["slot"]
        outputs["next_token_id"] = (items["token_id"] + items["position"]) % self.vocab
        return (n, 1)                        # (batch_size, backend_launches)

    def copy_pages(self, copies):            # COPY_OP records: copy src_page -> dst_page
        pass


greedy: qualia.RaggedBackend = GreedyBackend()
s.admit(2)
s.reserve(2, 1)
s.advance(2, 1)
s.complete_prefill(2, first_token=7)
receipt, outputs = s.decode(greedy)
assert receipt == (1, 1) and int(outputs["next_token_id"][0]) == 7 + 1

# -- README "Several replicas: the prefix router on Ray" ---------------------------------------

from qualia.cluster import Cluster, ReplicaConfig
from qualia.sim import Workload

config = ReplicaConfig(num_pages=192, max_num_seqs=8, logical_pages=24)
cl = Cluster(4, "prefix", config, local=True)   # local=False: Ray actors (after ray.init())
res = cl.run(Workload(requests=24, turns=3, system_prompts=8, arrival_rate=50, vocab=32000),
             kill_replica_at=20, rejoin_after=5)
print(res.summary["prefix_cache_hit_rate"], res.summary["mean_ttft_ms"], res.summary["resubmitted"],
      set(res.completions.values()))
