"""The kv-indexer service: a global prefix index folded from the workers' KV events
(services.common.kv_index, followed by services.common.kv_follow), answering overlap queries and
snapshotting it."""
