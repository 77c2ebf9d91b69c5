"""The evaluation and benchmark suite behind `pykvq eval | bench | passkey | report | results`.

settings  what a row is: K/V cache types, a converter transform, the online rotation
converted converted GGUFs, cached per (model, transform, target types)
store     resumable JSON result files (one row per setting, written as it finishes)
quality   KLD / p99 / same-top-1 / PPL against the f16 cache, from a saved base-logits file
speed     prefill and decode tokens/s at depth, KV bytes per token, peak RSS (one process per type)
passkey   passkey retrieval at increasing distance
report    docs/RESULTS.md and the PNG plots from the JSON files
"""
