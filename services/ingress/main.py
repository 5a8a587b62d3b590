"""Ingress process: the OpenAI HTTP API in front of the bus."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from pydantic import Field

from bus.client import Bus
from bus.runtime import run_service
from bus.settings import ServiceSettings
from observability.tracing import setup_tracing
from schemas.events import new_id
from services.common.tokenizer import ByteTokenizer, Tokenizer
from services.ingress.api import IngressApiSettings, create_app
from services.ingress.nats_gateway import NatsGateway


class IngressSettings(ServiceSettings):
    instance_id: str = Field(default_factory=new_id)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ("laneway-sim",)
    # The served model's folder, for its tokenizer and chat template; unset: the sim's bytes.
    model_dir: Path | None = None
    block_size: int = 16
    max_model_len: int = 32768
    default_max_tokens: int = 256
    request_timeout_s: float = 300.0


class _Server(uvicorn.Server):
    # The process's own stop event owns SIGINT/SIGTERM; uvicorn must not take them over.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _tokenizer(model_dir: Path | None) -> Tokenizer:
    if model_dir is None:
        return ByteTokenizer()
    from services.common.hf_tokenizer import HfTokenizer

    return HfTokenizer(model_dir)


def main() -> None:
    settings = IngressSettings()

    async def serve(stop: asyncio.Event) -> None:
        setup_tracing("laneway-ingress", settings.instance_id, settings.trace_exporter)
        bus = await Bus.connect(settings.nats_url, f"ingress-{settings.instance_id}")
        await bus.ensure_streams()
        gateway = NatsGateway(bus, settings.instance_id)
        await gateway.start()
        app = create_app(
            gateway,
            _tokenizer(settings.model_dir),
            IngressApiSettings(
                instance_id=settings.instance_id,
                served_model_names=settings.served_model_names,
                block_size=settings.block_size,
                max_model_len=settings.max_model_len,
                default_max_tokens=settings.default_max_tokens,
                request_timeout_s=settings.request_timeout_s,
            ),
        )
        server = _Server(
            uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port,
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=5,
            )
        )
        serving = asyncio.create_task(server.serve())
        await stop.wait()
        server.should_exit = True
        await serving
        await bus.close()

    run_service(serve, settings.log_level)


if __name__ == "__main__":
    main()
