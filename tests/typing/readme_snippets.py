"""The Python snippets of README.md, word for word.

.ci/run type-checks this file with mypy against the installed package, and tests/docs/test_readme.py
runs it and checks that every snippet of README.md is here unchanged.
"""

# ruff: noqa: B018, E402, F811, I001

# -- README "The engine step" --------------------------------------------------------------------
import numpy as np
import qualia

scheduler = qualia.StepScheduler(num_pages=1024, page_tokens=16, logical_pages=64,
                                 max_num_seqs=16, max_num_batched_tokens=512,
                                 max_prefill_chunk=256)
header = np.arange(1000, 1400, dtype=np.uint32)  # a 400-token system prompt
for rid in range(8):
    ids = np.concatenate([header, np.array([rid, 7, 8], dtype=np.uint32)])
    scheduler.add_request(rid, ids, max_new_tokens=16)

backend = qualia.HashBackend()  # stands in for a model: a hash of each row's token
while scheduler.has_unfinished():
    plan = scheduler.schedule()  # input_ids, positions, slot_mapping, block_table, kv_indptr, ...
    sampled = backend.execute_step(plan)  # one forward over the mixed batch, one token a row
    for done in scheduler.update(sampled):  # stop conditions applied; pages go to the cache
        assert isinstance(done, qualia.FinishedRequest)  # a FinishedGroup for n > 1
        print(done.request_id, done.finish_reason, done.output_tokens[:4])

for rid in range(8, 16):
    scheduler.add_request(rid, np.arange(rid, rid + 40, dtype=np.uint32), max_new_tokens=16)
result = scheduler.run(backend)  # the whole loop in C without the GIL (a C backend)
print(len(result.finished), result.totals["num_tokens"], scheduler.cache_stats().hit_tokens)
