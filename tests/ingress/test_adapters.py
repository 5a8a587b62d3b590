"""A request naming a LoRA adapter as its model: served by the adapter's base model with the
adapter (its name and path on the spec), its prompt's blocks salted apart from the base model's
and from every other adapter's; refused where no worker of the base model holds adapters; the
load and unload endpoints' checks."""

from __future__ import annotations

import orjson
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from bus.adapters import AdapterRecord
from services.common.tokenizer import ByteTokenizer
from services.ingress.adapters import AdapterEndpoints, Adapters
from services.ingress.context_limit import WorkerContextLimit
from services.ingress.errors import ApiError, InvalidRequest
from services.ingress.intake import Intake
from services.ingress.openai_models import parse_completion_request
from services.ingress.settings import IngressApiSettings
from services.ingress.worker_features import WorkerFeatures
from tests.ingress.features import features_of, worker
from tests.ingress.helpers import MODEL


async def intake_with(*records: AdapterRecord, max_loras: int = 2) -> Intake:
    adapters = Adapters()
    await adapters.on_adapters(records)
    features = await features_of(
        worker("w1", "sim", False).model_copy(update={"max_loras": max_loras})
    )
    settings = IngressApiSettings(instance_id="i", served_model_names=(MODEL, "other"))
    return Intake(ByteTokenizer(), settings, WorkerContextLimit(), features, adapters)


def asking(model: str) -> bytes:
    return orjson.dumps(
        {"model": model, "prompt": "the same prompt, block after block", "max_tokens": 2}
    )


async def test_an_adapter_runs_on_its_base_model_salted_apart() -> None:
    intake = await intake_with(
        AdapterRecord(name="ad-1", base_model=MODEL, path="/a/1"),
        AdapterRecord(name="ad-2", base_model=MODEL, path="/a/2"),
    )
    base = intake.spec(parse_completion_request(asking(MODEL)))
    one = intake.spec(parse_completion_request(asking("ad-1")))
    two = intake.spec(parse_completion_request(asking("ad-2")))
    assert (base.lora, base.lora_path) == (None, None)
    assert (one.model, one.lora, one.lora_path) == (MODEL, "ad-1", "/a/1")
    assert two.lora == "ad-2"
    # Same prompt, three caches: an adapter changes the KV of every token.
    hashes = {base.block_hashes[0], one.block_hashes[0], two.block_hashes[0]}
    assert len(hashes) == 3 and one.prompt_token_ids == base.prompt_token_ids


async def test_an_unknown_adapter_or_one_on_an_unserved_model_is_not_found() -> None:
    intake = await intake_with(AdapterRecord(name="stray", base_model="gone", path="/p"))
    for model in ("stray", "nope"):
        with pytest.raises(ApiError) as refused:
            intake.spec(parse_completion_request(asking(model)))
        assert (refused.value.status, refused.value.code) == (404, "model_not_found")


async def test_an_adapter_is_refused_where_no_worker_holds_adapters() -> None:
    intake = await intake_with(AdapterRecord(name="ad-1", base_model=MODEL, path="/p"), max_loras=0)
    with pytest.raises(InvalidRequest, match="--max-loras"):
        intake.spec(parse_completion_request(asking("ad-1")))
    assert intake.spec(parse_completion_request(asking(MODEL))).lora is None


def admin_app(models: tuple[str, ...]) -> tuple[TestClient, dict[str, AdapterRecord]]:
    """The two endpoints over a dict standing in for etcd (the e2e test has etcd's)."""
    stored: dict[str, AdapterRecord] = {}

    async def add(record: AdapterRecord) -> bool:
        return stored.setdefault(record.name, record) is record

    async def remove(name: str) -> bool:
        return stored.pop(name, None) is not None

    endpoints = AdapterEndpoints(Adapters(), models, add, remove)
    app = Starlette(
        routes=[
            Route("/load", endpoints.load, methods=["POST"]),
            Route("/unload", endpoints.unload, methods=["POST"]),
        ]
    )
    return TestClient(app), stored


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_path": "/p"}, "lora_name"),
        ({"lora_name": "a b", "lora_path": "/p"}, "lora_name"),
        ({"lora_name": "x" * 129, "lora_path": "/p"}, "lora_name"),
        ({"lora_name": 7, "lora_path": "/p"}, "lora_name"),
        ({"lora_name": "ok"}, "lora_path"),
        ({"lora_name": "ok", "lora_path": ""}, "lora_path"),
        ({"lora_name": "ok", "lora_path": "/p" * 3000}, "lora_path"),
        ({"lora_name": "ok", "lora_path": "/p"}, "base_model_name"),  # two models served
        ({"lora_name": "ok", "lora_path": "/p", "base_model_name": "zz"}, "base_model_name"),
        ({"lora_name": "other", "lora_path": "/p", "base_model_name": MODEL}, "lora_name"),
    ],
)
def test_a_bad_load_is_refused_naming_its_field(body: dict[str, object], param: str) -> None:
    client, stored = admin_app((MODEL, "other"))
    refused = client.post("/load", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert stored == {}


def test_one_served_model_is_every_adapters_base() -> None:
    client, stored = admin_app((MODEL,))
    assert (
        client.post("/load", json={"lora_name": "org/ad:v1", "lora_path": "/p"}).status_code == 200
    )
    assert stored["org/ad:v1"].base_model == MODEL
    assert client.post("/load", content=b"[1]").status_code == 400
    assert client.post("/load", content=b"{" + b" " * 20_000 + b"}").status_code == 413
    assert client.post("/unload", json={"lora_name": "org/ad:v1"}).status_code == 200
    assert stored == {}


def test_features_with_no_worker_known_refuse_nothing() -> None:
    WorkerFeatures().check_adapters(MODEL)  # the planner fails it if none turns up
