"""The prefill worker: ``python -m services.worker.prefill_worker`` starts a worker in role
``prefill``."""

import os

from bus.runtime import without_websockets


def main() -> None:
    # Imported here, so that the entry point below comes first.
    from services.worker.runtime import worker_main

    worker_main("prefill")


if __name__ == "__main__":
    # TensorRT-LLM's own modules may want aiohttp.
    if os.environ.get("LANEWAY_ENGINE", "sim") != "trtllm":
        without_websockets()
    main()
