"""What a worker's entry point runs, in its role: the one check that must come before nats-py is
imported, then the worker."""

import os

from bus.runtime import without_websockets
from schemas.envelope import Role


def start(role: Role) -> None:
    # TensorRT-LLM's and vLLM's own modules import aiohttp.
    if os.environ.get("LANEWAY_ENGINE", "sim") not in ("trtllm", "vllm"):
        without_websockets()
    # Imported only now, after that check.
    from services.worker.runtime import worker_main

    worker_main(role)
