"""The checks that need a GPU, as one short script (``make gpu-check``).

1. The torch engine on CUDA decodes greedily exactly what it decodes on the CPU, on the tiny
   seeded model written to a temporary directory.
2. If ``tensorrt_llm`` imports and ``LANEWAY_TRTLLM_MODEL`` names a Hugging Face model directory,
   the TensorRT-LLM adapter generates there, serves a repeated prompt from its prefix cache, and
   its KV events hash the prompt's blocks as Laneway does.

Prints a short report; exits 1 on any mismatch, 2 without a CUDA device.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from schemas.block_hash import chain_block_hashes
from schemas.events import SamplingParams
from services.common.hf_tokenizer import HfTokenizer
from services.engine.protocol import BlocksStored, Engine, EngineRequest
from services.engine.torch_engine import TorchEngine, TorchEngineConfig
from services.engine.torch_engine.tiny import make_tiny_model

PROMPTS = (
    "Where does the ferry go?",
    "Tell me about the library under the copper dome.",
    "Write a short poem about fog on the river.",
    "List three things found in the lost property cupboard.",
)
MAX_TOKENS = 24
TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def _prompts(tokenizer: HfTokenizer) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([Message("user", p)])) for p in PROMPTS]


def _generate(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Greedy completions of all prompts, batched, and the wall time they took."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", tuple(prompt), greedy))
    outputs: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    pending = set(outputs)
    started = time.perf_counter()
    while pending:
        if time.perf_counter() - started > TIMEOUT_S:
            raise TimeoutError(f"requests {sorted(pending)} did not finish")
        for out in engine.step().outputs:
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                pending.discard(out.request_id)
    return list(outputs.values()), time.perf_counter() - started


def check_torch_engine() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny"
        make_tiny_model(model_dir)
        prompts = _prompts(HfTokenizer(model_dir))
        cpu, cpu_s = _generate(TorchEngine(model_dir, TorchEngineConfig(device="cpu")), prompts)
        cuda, cuda_s = _generate(TorchEngine(model_dir, TorchEngineConfig(device="cuda")), prompts)
    ok = True
    for i, (want, got) in enumerate(zip(cpu, cuda, strict=True)):
        if want != got:
            ok = False
            pairs = enumerate(zip(want, got, strict=False))
            at = next((k for k, (a, b) in pairs if a != b), min(len(want), len(got)))
            print(f"  prompt {i}: CUDA and CPU part at token {at}:")
            print(f"    cuda {got[at : at + 8]}\n    cpu  {want[at : at + 8]}")
    tokens = sum(len(c) for c in cuda)
    print(
        f"torch engine: {'ok' if ok else 'MISMATCH'}, {len(prompts)} x {MAX_TOKENS} tokens; "
        f"cpu {cpu_s:.2f} s, cuda {cuda_s:.2f} s ({tokens / cuda_s:.0f} tokens/s)"
    )
    return ok


def check_trtllm(model: Path) -> bool:
    from services.engine.trtllm_engine import TrtllmEngine, TrtllmEngineConfig

    tokenizer = HfTokenizer(model)
    prompts = _prompts(tokenizer)
    # Long enough to fill several blocks, so that the repeat has something to find.
    shared = tokenizer.encode(" ".join(PROMPTS) * 4)
    with TrtllmEngine(TrtllmEngineConfig(model_dir=model)) as engine:
        outputs, seconds = _generate(engine, prompts)
        first, _ = _generate(engine, [shared])
        stored: set[int] = set()
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest("repeat", tuple(shared), greedy))
        cached = None
        deadline = time.perf_counter() + TIMEOUT_S
        expected = set(chain_block_hashes(shared, engine.block_size))
        # Step on until the repeat ends and (with events) every prompt block was announced.
        while cached is None or (engine.capabilities.kv_events and not stored >= expected):
            if time.perf_counter() > deadline:
                break
            result = engine.step()
            for out in result.outputs:
                if out.cached_tokens is not None:
                    cached = out.cached_tokens
            for change in result.kv_changes:
                if isinstance(change, BlocksStored):
                    stored.update(change.block_hashes)
        block_size, events = engine.block_size, engine.capabilities.kv_events
    ok = all(len(o) == MAX_TOKENS for o in outputs) and len(first[0]) == MAX_TOKENS
    reused = cached is not None and cached >= block_size
    hashed = not events or stored >= expected
    ok = ok and reused and hashed
    tokens = sum(len(o) for o in outputs)
    if not events:
        kv = "off"
    else:
        kv = "hash as Laneway does" if hashed else "DIFFER from Laneway's hashes"
    print(
        f"trtllm adapter: {'ok' if ok else 'MISMATCH'}, {tokens} tokens in {seconds:.2f} s; "
        f"repeat served {cached} cached tokens (block size {block_size}); KV events {kv}"
    )
    for text, completion in zip(PROMPTS, outputs, strict=True):
        print(f"  {text!r} -> {tokenizer.decode(completion)!r}")
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"device: {torch.cuda.get_device_name()}")
    ok = check_torch_engine()
    model = os.environ.get("LANEWAY_TRTLLM_MODEL")
    missing = _trtllm_missing()
    if missing is not None:
        print(f"trtllm adapter: skipped, tensorrt_llm does not import ({missing})")
    elif not model:
        print("trtllm adapter: skipped, LANEWAY_TRTLLM_MODEL is not set")
    else:
        ok = check_trtllm(Path(model)) and ok
    return 0 if ok else 1


def _trtllm_missing() -> str | None:
    """Why ``tensorrt_llm`` does not import, or None if it does."""
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
