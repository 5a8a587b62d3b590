"""vLLM engines for the engine tests: loaded once per test process and handed out emptied.

Loading one takes 10-40 s on 2 cores, and the contract's tests want a fresh engine several times
each, two at once for a hand-off. So a pool holds two and hands them out in turn, each with its
requests aborted and its prefix cache reset: what a fresh engine holds."""

from __future__ import annotations

from pathlib import Path

from services.engine.vllm_engine import VllmEngine, VllmEngineConfig

# The contract's pool: 64 blocks of 32 tokens, which is also the longest request.
BLOCK = 32
NUM_BLOCKS = 64
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 256


class VllmPool:
    def __init__(self, model_dir: Path) -> None:
        self._config = VllmEngineConfig(
            model_dir,
            block_size=BLOCK,
            max_model_len=BLOCK * NUM_BLOCKS,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            # A KV size of its own: vLLM's CPU build otherwise wants 90% of the machine's memory
            # free at start, which a loaded test machine does not have.
            kv_cache_gib=0.25,
            # vLLM keeps one block aside: 64 hold tokens.
            # No torch.compile: its warm-up is most of a load (tests/e2e/vllm_cluster.py).
            extra_args={"num_gpu_blocks_override": NUM_BLOCKS + 1, "enforce_eager": True},
        )
        self._engines: list[VllmEngine] = []
        self._turn = 0

    def fresh(self) -> VllmEngine:
        """The next engine, as if just loaded. The one handed out before it stays as it is."""
        if len(self._engines) < 2:
            self._engines.append(VllmEngine(self._config))
            return self._engines[-1]
        engine = self._engines[self._turn]
        self._turn ^= 1
        _empty(engine)
        return engine


def _empty(engine: VllmEngine) -> None:
    # Through the engine's insides: emptying an engine is no part of the protocol the worker
    # drives, and a test pool is its only user.
    for request_id in list(engine._started):
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    # The connector's too: hand-off blocks staged and never loaded are part of what it held.
    assert engine._engine.reset_prefix_cache(reset_connector=True)
    # The reset's AllBlocksCleared comes with the next step: taken here, as a fresh engine has
    # announced nothing.
    engine.step()
    assert not engine.has_work()
