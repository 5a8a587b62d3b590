"""Pure libraries shared by the services and the engines: the perf model, the KV transfer
model and the tokenizers. Nothing here imports the bus, etcd or torch."""
