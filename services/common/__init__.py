"""Pure libraries shared by the services and the engines: the perf model, the KV transfer
model, the tokenizers and the prefix index with its fold (``kv_index``: the kv-indexer's, each
planner's own and the simulator's). Nothing here imports the bus, etcd or torch."""
