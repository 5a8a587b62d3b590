"""Local cluster plumbing: embedded NATS and etcd, process supervision, the `laneway` CLI."""
