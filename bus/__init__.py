"""NATS JetStream wiring: every stream, consumer and subject is declared here, once."""
