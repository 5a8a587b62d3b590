"""The global prefix index and its fold of the workers' KV events, shared by the kv-indexer,
each planner that folds the KV stream itself, and the offline simulator."""
