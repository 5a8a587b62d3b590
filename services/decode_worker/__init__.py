"""The decode-worker service."""
