"""Whose cached prompt blocks a request may meet: its cache salt, which enters the first block's
hash (:func:`schemas.block_hash.salt_root`), so that requests share blocks only under one salt.

- **Per cache group.** With API keys, each key belongs to a cache group: its tenant's by
  default, another's where the operator chose one (``laneway keys create --cache-group``). The
  group's salt is a keyed hash (HMAC-SHA256) of the group's name under a random secret that only
  the keys' records in etcd hold (``bus.api_keys``): nobody without it can compute the salt, nor
  a block hash under it.
- **A client's salt narrows.** A request's own ``cache_salt`` (vLLM's field of that name) is
  hashed with its group's salt: the same value from another group meets none of its blocks.
  With keys off there is no group, and requests without one share one cache, as before salts.
- **Per LoRA adapter.** An adapter changes the KV of every token it runs on: a request with one
  is salted again with the adapter's name, so it meets only blocks computed with that adapter.

Pure functions: the ingress and the offline bench (``laneway bench --tenants``) call the same.
"""

from __future__ import annotations

import hashlib
import hmac

# 128 bits, hex: a salt travels in every RequestSpec.
SALT_CHARS = 32
# A client's cache_salt; longer is no salt but a payload.
MAX_CLIENT_SALT_CHARS = 256


def group_salt(secret: bytes, group: str) -> str:
    """The salt of a cache group, under the secret its keys' records hold."""
    mac = hmac.new(secret, b"laneway cache group\0" + group.encode(), hashlib.sha256)
    return mac.hexdigest()[:SALT_CHARS]


def request_salt(group: str | None, client: str | None) -> str | None:
    """A request's salt: its group's (None with keys off), narrowed by the client's own. A group
    salt has a fixed length, so the hashed bytes split back into the two salts one way only."""
    if client is None:
        return group
    payload = b"laneway client salt\0" + (group or "").encode() + b"\0" + client.encode()
    return hashlib.sha256(payload).hexdigest()[:SALT_CHARS]


def adapter_salt(salt: str | None, lora: str | None) -> str | None:
    """The salt of a request run with the LoRA adapter ``lora`` (None: the base model's,
    ``salt`` unchanged), ``salt`` its salt without one."""
    if lora is None:
        return salt
    payload = b"laneway lora\0" + (salt or "").encode() + b"\0" + lora.encode()
    return hashlib.sha256(payload).hexdigest()[:SALT_CHARS]
