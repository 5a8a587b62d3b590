"""vLLM's own OpenAI server, as `python -m vllm.entrypoints.openai.api_server ARGS` runs it, with
the CPU wheel's broken media packages hidden (services.engine.vllm_engine.compat): the yardstick
of `make bench-overhead`. Hidden at import, so that the engine-core process vLLM spawns, which
imports this module again as its main, hides them too.

    python -m benchmarks.vllm_server --model DIR --port 8100 [vLLM's arguments]
"""

from __future__ import annotations

from services.engine.vllm_engine.compat import import_vllm

import_vllm()

if __name__ == "__main__":
    # What `python -m vllm.entrypoints.openai.api_server` runs, with this module left as the
    # main one that spawned processes import.
    from vllm.entrypoints.launchers.api_server.entry import main

    main()  # type: ignore[no-untyped-call]
