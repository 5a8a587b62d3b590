"""The scheduler and paged, prefix-cached block manager that the sim and torch engines both
run on: continuous batching, chunked prefill, preemption by recompute, LRU eviction."""
