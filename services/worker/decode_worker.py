"""The decode worker: ``python -m services.worker.decode_worker`` starts a worker in role
``decode`` (``LANEWAY_ROLE=both`` serves requests end to end, aggregated)."""

import os

from bus.runtime import without_websockets


def main() -> None:
    # Imported here, so that the entry point below comes first.
    from services.worker.runtime import worker_main

    worker_main("decode")


if __name__ == "__main__":
    # TensorRT-LLM's own modules may want aiohttp.
    if os.environ.get("LANEWAY_ENGINE", "sim") != "trtllm":
        without_websockets()
    main()
