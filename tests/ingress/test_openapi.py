"""The OpenAPI document the API serves: its request schemas take the parser's limits and the
served models, and the parser takes every example the schemas give (the fuzz run, live, sends
many more)."""

from __future__ import annotations

from typing import Any

import schemathesis

from services.common.tokenizer import ByteTokenizer
from services.ingress.openai_models import MAX_MESSAGES, MAX_STOP_SEQUENCES
from tests.ingress.helpers import MODEL, harness


async def document(**settings: Any) -> dict[str, Any]:
    async with harness(**settings) as h:
        response = await h.client.get("/openapi.json")
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


async def test_the_document_describes_the_endpoints_and_their_errors() -> None:
    doc = await document(max_model_len=128)
    schema = schemathesis.openapi.from_dict(doc)
    assert {op.ok().path for op in schema.get_all_operations()} == {  # type: ignore[union-attr]
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model}",
    }
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat) >= {"200", "400", "404", "413", "415", "429", "500", "502", "503", "504"}
    assert "Retry-After" in chat["429"]["headers"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}


async def test_request_schemas_take_the_parsers_limits() -> None:
    doc = await document(max_model_len=128, served_model_names=(MODEL, "other"))
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == [MODEL, "other"]
    assert chat["messages"]["maxItems"] == MAX_MESSAGES
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 128
    assert chat["stop"]["anyOf"][1]["maxItems"] == MAX_STOP_SEQUENCES
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[1]["items"]["maximum"] == ByteTokenizer().vocab_size - 1


async def test_a_documented_request_is_answered() -> None:
    async with harness() as h:
        body = {"model": MODEL, "prompt": [[1, 2.0, 3]], "max_tokens": 2.0, "seed": 4.0}
        response = await h.client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
