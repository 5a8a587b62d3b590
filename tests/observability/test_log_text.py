"""Escaping what a log line quotes (observability.log_text)."""

from __future__ import annotations

import logging

from observability.log_text import EscapingFormatter, escaped


def test_what_ends_or_reorders_a_line_is_escaped_and_the_rest_kept() -> None:
    text = "a\nb\rc\td\x00\x1b[2J\x7f\x85\u2028\u2029\u202e\u2066 é 日本 \\n"
    assert escaped(text) == (
        "a\\nb\\rc\\td\\x00\\x1b[2J\\x7f\\x85\\u2028\\u2029\\u202e\\u2066 é 日本 \\n"
    )
    assert escaped("/v1/a b=c\n", field=True) == "/v1/a\\x20b=c\\n"
    plain = "POST /v1/completions status=200"
    assert escaped(plain) is plain


def test_every_message_of_a_service_log_is_escaped() -> None:
    """The services' formatter (bus.runtime): whatever a message quotes stays on its line; a
    traceback after it keeps its own lines."""
    formatter = EscapingFormatter("%(levelname)s %(name)s: %(message)s")
    try:
        raise ValueError("boom")
    except ValueError as exc:
        record = logging.LogRecord(
            "svc", logging.WARNING, __file__, 1, "dropping %s", ("a\nINFO svc: forged",), None
        )
        record.exc_info = (type(exc), exc, exc.__traceback__)
    first, *traceback = formatter.format(record).splitlines()
    assert first == "WARNING svc: dropping a\\nINFO svc: forged"
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: boom"
