"""vLLM's own answers, the yardstick of the vLLM end-to-end tests: ``vllm.LLM(...).generate`` on
token-id prompts, greedy, in a process of its own (``python -m tests.e2e.vllm_reference
REQUEST.json ANSWERS.json``), so that the test process neither holds a model nor takes vLLM's
settings of torch, and the model loads while the cluster's workers load theirs.

The engine core runs in that process (multiprocessing off), as it does in Laneway's worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The host memory its KV cache takes: the tiny model's prompts need a few MiB.
_KV_CACHE_BYTES = 256 << 20
# Most likely tokens at each position, beside each answer token's log probability.
TOP_LOGPROBS = 2


class Reference:
    """vLLM's greedy answers to ``prompts``, being computed in a subprocess from the start."""

    def __init__(
        self, model_dir: Path, prompts: Sequence[Sequence[int]], max_tokens: int, folder: Path
    ) -> None:
        request = {"model": str(model_dir), "prompts": [list(p) for p in prompts]}
        (folder / "request.json").write_text(json.dumps({**request, "max_tokens": max_tokens}))
        self._out = folder / "answers.json"
        self._log = folder / "reference.log"
        with self._log.open("wb") as log:  # the child holds it
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(folder / "request.json"), str(self._out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            )
        self._answers: list[dict[str, Any]] | None = None

    def _read(self, timeout: float) -> list[dict[str, Any]]:
        if self._answers is None:
            code = self._proc.wait(timeout)
            assert code == 0, self._log.read_text()[-4000:]
            self._answers = json.loads(self._out.read_text())
        return self._answers

    def answers(self, timeout: float = 240.0) -> list[list[int]]:
        """The generated token ids of each prompt, in order."""
        return [answer["tokens"] for answer in self._read(timeout)]

    def logprobs(self, timeout: float = 240.0) -> list[list[tuple[float, list[list[Any]]]]]:
        """Each prompt's answer tokens' log probabilities, and at each position the
        ``TOP_LOGPROBS`` most likely tokens as [id, log probability], most likely first."""
        return [[(lp, top) for lp, top in answer["logprobs"]] for answer in self._read(timeout)]

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _generate(request: dict[str, object]) -> list[dict[str, Any]]:
    from services.engine.vllm_engine.compat import import_vllm

    import_vllm()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # As Laneway's test workers run it: 32-token blocks (vLLM's CPU attention takes multiples of
    # 32), eager, and the checkpoint's float32 (LANEWAY_DTYPE's default; vLLM's own on a CPU is
    # bfloat16).
    llm = LLM(
        model=str(request["model"]),
        block_size=32,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=_KV_CACHE_BYTES,
    )
    max_tokens = request["max_tokens"]
    prompts = request["prompts"]
    assert isinstance(max_tokens, int) and isinstance(prompts, list)
    greedy = SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy)
    answers = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = []
        for token_id, position in zip(completion.token_ids, completion.logprobs or (), strict=True):
            assert position is not None
            ranked = sorted(position.items(), key=lambda item: item[1].rank)[:TOP_LOGPROBS]
            top = [[t, p.logprob] for t, p in ranked]
            logprobs.append([position[token_id].logprob, top])
        answers.append({"tokens": list(completion.token_ids), "logprobs": logprobs})
    return answers


if __name__ == "__main__":
    given, answers = map(Path, sys.argv[1:3])
    answers.write_text(json.dumps(_generate(json.loads(given.read_text()))))
