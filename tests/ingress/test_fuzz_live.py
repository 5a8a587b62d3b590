"""Bad input, fuzzed: schemathesis generates requests from the live API's own OpenAPI document,
valid and invalid ones, and every answer must be no 5xx and must match the document (status,
content type, body schema), while seeded streams running beside the fuzz stay exact."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from infra.cluster import LocalCluster
from tests.e2e.exact import MAX_TOKENS, SEEDS, answers, mismatch, stream
from tests.live import ClusterFactory

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Generated requests per completion endpoint and mode: 1,040 in all, with /v1/models.
EXAMPLES = {GenerationMode.POSITIVE: 300, GenerationMode.NEGATIVE: 220}


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> LocalCluster:
    # A short context keeps every valid request's answer short; sped up, so it is quick too.
    env = {"LANEWAY_MAX_MODEL_LEN": "96", "LANEWAY_SPEEDUP": "5"}
    return cluster_factory(workers=2, env=env)


class Streams:
    """Seeded streams sent while the fuzz runs, each compared with its unstreamed answer."""

    def __init__(self, base_url: str, headers: dict[str, str]) -> None:
        self._base_url = base_url
        self._headers = headers
        self._stop = threading.Event()
        self.sent = 0
        self.wrong: list[str] = []

    # Two at once: four took the GIL from the fuzz's generation (149 s against 127 s here).
    async def run(self, concurrency: int = 2) -> None:
        async with httpx.AsyncClient(
            base_url=self._base_url, headers=self._headers, timeout=30.0
        ) as http:
            whole = await answers(http)
            rng = random.Random(8)

            async def loop() -> None:
                while not self._stop.is_set():
                    seed, max_tokens = rng.randrange(SEEDS), rng.randint(1, MAX_TOKENS)
                    found = mismatch(await stream(http, seed, max_tokens), whole[seed])
                    self.sent += 1
                    if found is not None:
                        self.wrong.append(found)

            await asyncio.gather(*(loop() for _ in range(concurrency)))

    def stop(self) -> None:
        self._stop.set()


@contextmanager
def streams_beside(base_url: str, headers: dict[str, str]) -> Iterator[Streams]:
    streams = Streams(base_url, headers)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(streams.run())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=target, name="exact-streams")
    thread.start()
    try:
        yield streams
    finally:
        streams.stop()
        thread.join(60)
    assert not errors, errors


def fuzz(operation: Any, mode: GenerationMode, examples: int, call: Callable[[Any], None]) -> None:
    """Send ``examples`` requests generated for ``operation``, each to ``call``."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        call(case)

    run()


def test_fuzzed_requests_get_no_5xx_and_leave_concurrent_streams_exact(
    cluster: LocalCluster,
) -> None:
    api = cluster.config.base_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_dict(
        httpx.get(f"{api}/openapi.json", headers=cluster.api_headers).json()
    )
    sent: dict[str, int] = {}

    def call(case: Any) -> None:
        response = case.call(base_url=api, headers=cluster.api_headers, timeout=30)
        key = f"{case.method} {case.path} {response.status_code}"
        sent[key] = sent.get(key, 0) + 1
        case.validate_response(response, checks=CHECKS)

    with streams_beside(cluster.config.base_url, cluster.api_headers) as streams:
        for path in ("/v1/chat/completions", "/v1/completions"):
            for mode, examples in EXAMPLES.items():
                fuzz(schema[path]["POST"], mode, examples, call)
        fuzz(schema["/v1/models"]["GET"], GenerationMode.POSITIVE, 5, call)
    total = sum(sent.values())
    assert total >= 1000, sent
    assert not any(key.endswith(("500", "502", "503", "504")) for key in sent), sent
    # Valid requests were among them, answered in full.
    assert sent.get("POST /v1/completions 200", 0) > 50, sent
    assert sent.get("POST /v1/chat/completions 200", 0) > 50, sent
    assert streams.sent > 20
    assert not streams.wrong, streams.wrong[:5]
