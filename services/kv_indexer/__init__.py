"""The kv-indexer service: a global prefix index folded from the workers' KV events."""
