"""Cache salts (schemas.cache_salt, schemas.block_hash.salt_root): the salt enters the first
block's hash alone and the chain carries it; a group's salt needs its secret; a client's salt
narrows a group's sharing and cannot reach another group's; unsalted hashes are today's."""

from __future__ import annotations

from datetime import UTC, datetime

from bus.api_keys import ApiKeyRecord, key_hash
from infra.recording import redacted
from schemas.block_hash import ROOT_HASH, chain_block_hashes, hash_block, salt_root
from schemas.cache_salt import SALT_CHARS, group_salt, request_salt
from schemas.codec import decode_event, encode
from schemas.events import RequestAccepted, RequestSpec, SamplingParams
from services.ingress.migration import continued

TOKENS = tuple(range(40))


def test_the_salt_is_the_first_blocks_parent_and_the_chain_carries_it() -> None:
    assert salt_root(None) == ROOT_HASH
    assert chain_block_hashes(TOKENS, 8, salt_root(None)) == chain_block_hashes(TOKENS, 8)
    salted = chain_block_hashes(TOKENS, 8, salt_root("a" * SALT_CHARS))
    # Only the first block's parent differs; every later block is hashed as before, from it.
    assert salted[0] == hash_block(salt_root("a" * SALT_CHARS), TOKENS[:8])
    assert salted[1] == hash_block(salted[0], TOKENS[8:16])
    others = chain_block_hashes(TOKENS, 8, salt_root("b" * SALT_CHARS))
    assert set(salted).isdisjoint(others)
    assert set(salted).isdisjoint(chain_block_hashes(TOKENS, 8))


def test_a_group_salt_needs_the_groups_secret() -> None:
    secret = bytes(range(16))
    salt = group_salt(secret, "acme")
    assert len(salt) == SALT_CHARS and salt == group_salt(secret, "acme")
    assert salt != group_salt(secret, "other")
    assert salt != group_salt(bytes(16), "acme")


def test_a_client_salt_narrows_and_never_reaches_another_group() -> None:
    acme, other = group_salt(b"1" * 16, "acme"), group_salt(b"2" * 16, "other")
    assert request_salt(None, None) is None  # keys off, no salt: unsalted, as before
    assert request_salt(acme, None) == acme
    narrowed = request_salt(acme, "private")
    assert narrowed not in (None, acme)
    assert narrowed == request_salt(acme, "private")
    assert narrowed != request_salt(other, "private")
    assert narrowed != request_salt(None, "private")
    # Whatever a client sends, it cannot name its group's salt, nor another group's.
    assert request_salt(other, acme) != acme


def record(tenant: str, key: str, **fields: object) -> ApiKeyRecord:
    return ApiKeyRecord(
        key_id=key_hash(key)[:16],
        tenant=tenant,
        sha256=key_hash(key),
        created_at=datetime(2026, 12, 6, tzinfo=UTC),
        **fields,
    )


def test_a_records_salt_is_its_groups_and_an_old_record_keeps_to_itself() -> None:
    secret = "0f" * 16
    first = record("acme", "lw-one", cache_secret=secret)
    second = record("acme", "lw-two", cache_secret=secret)
    partner = record("partner", "lw-three", cache_secret=secret, cache_group="acme")
    assert first.cache_salt() == second.cache_salt() == partner.cache_salt()
    assert first.cache_salt() == group_salt(bytes.fromhex(secret), "acme")
    # Made before groups: no secret, a salt of its own key's, which nobody else has.
    old_one, old_two = record("acme", "lw-four"), record("acme", "lw-five")
    assert old_one.cache_salt() != old_two.cache_salt()
    assert first.cache_salt() not in (old_one.cache_salt(), old_two.cache_salt())


def accepted(cache_salt: str | None) -> RequestAccepted:
    spec = RequestSpec(
        model="m",
        prompt_token_ids=TOKENS,
        block_size=8,
        block_hashes=chain_block_hashes(TOKENS, 8, salt_root(cache_salt)),
        sampling=SamplingParams(max_tokens=4),
        reply_to="ingress-1",
        deadline=datetime(2026, 12, 6, tzinfo=UTC),
        tenant="acme",
        cache_salt=cache_salt,
    )
    return RequestAccepted(source="ingress/1", request_id="r1", spec=spec)


def test_events_recorded_before_salts_decode_unsalted() -> None:
    raw = encode(accepted(None))
    old = raw.replace(b',"cache_salt":null', b"")
    assert old != raw  # the field is gone, as in a recording made before it
    event = decode_event(old)
    assert isinstance(event, RequestAccepted) and event.spec.cache_salt is None
    assert event == decode_event(raw)


def test_a_redacted_recording_keeps_the_hashes_and_drops_the_salt() -> None:
    event = accepted("c" * SALT_CHARS)
    hidden = redacted(event)
    assert isinstance(hidden, RequestAccepted)
    assert hidden.spec.cache_salt is None and hidden.spec.prompt_token_ids == ()
    assert hidden.spec.block_hashes == event.spec.block_hashes


def test_a_migrated_request_continues_in_its_salted_chain() -> None:
    spec = accepted("d" * SALT_CHARS).spec
    moved = continued(spec, (7, 8, 9, 10), attempt=1)
    prompt = (*TOKENS, 7, 8, 9, 10)
    assert moved.cache_salt == spec.cache_salt
    assert moved.block_hashes == chain_block_hashes(prompt, 8, salt_root(spec.cache_salt))
