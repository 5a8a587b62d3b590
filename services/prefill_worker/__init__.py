"""The prefill-worker service."""
