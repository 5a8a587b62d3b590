"""The worker service: takes routed requests from the bus, drives an engine's steps in real time,
and publishes tokens, terminal events, KV events and load reports. ``prefill_worker`` and
``decode_worker`` are its two deployable entry points."""
