"""`laneway bench-engine`: the torch engine against Hugging Face `transformers` on one machine.

Same weights, same prompts, greedy decoding, measured in the same run: output tokens per second
at several concurrencies, and the time to first token of a long prompt, cold and fully cached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.arg_types import at_least
from schemas.events import SamplingParams
from services.engine.protocol import EngineRequest

if TYPE_CHECKING:
    from services.engine.torch_engine.engine import TorchEngine


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench-engine", help="torch engine vs transformers on a local model")
    bench.add_argument("--model", type=Path, required=True, help="Hugging Face layout folder")
    bench.add_argument(
        "--concurrency",
        type=at_least(1),
        action="append",
        help="requests at once; repeatable (default: 1, 8, 32)",
    )
    bench.add_argument(
        "--prompt-tokens", type=at_least(1), default=64, help="prompt length of the throughput runs"
    )
    bench.add_argument(
        "--output-tokens",
        type=at_least(1),
        default=64,
        help="tokens each throughput request generates",
    )
    bench.add_argument(
        "--long-prompt-tokens",
        type=at_least(1),
        default=2000,
        help="prompt length of the time-to-first-token runs",
    )
    bench.add_argument("--json", type=Path, help="write the figures here")
    bench.set_defaults(func=main)


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    # Skip the lowest ids: special tokens live there in the tiny model's vocabulary.
    return torch.randint(16, vocab, (length,), generator=generator).tolist()


def _engine(model: Path) -> TorchEngine:
    from services.engine.torch_engine.config import TorchEngineConfig
    from services.engine.torch_engine.engine import TorchEngine

    return TorchEngine(
        model,
        TorchEngineConfig(num_gpu_blocks=2048, max_num_seqs=64, max_num_batched_tokens=4096),
    )


def _run(engine: TorchEngine, prompts: list[list[int]], output_tokens: int, tag: str) -> float:
    """Seconds until every request finished."""
    greedy = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, greedy))
    while engine.has_work():
        engine.step()
    return time.perf_counter() - started


def _ttft(engine: TorchEngine, prompt: list[int], tag: str) -> tuple[float, int]:
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(EngineRequest(tag, prompt, one))
    cached = 0
    while engine.has_work():
        for output in engine.step().outputs:
            cached = output.cached_tokens or cached
    return time.perf_counter() - started, cached


def hf_greedy(model: Any, prompts: list[list[int]], output_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, exactly ``output_tokens`` new tokens per prompt; the
    prompts must be of equal length (no padding)."""
    import torch

    batch = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=output_tokens,
            min_new_tokens=output_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [row[batch.shape[1] :] for row in out.tolist()]


def _hf_generate(model: Any, prompts: list[list[int]], output_tokens: int) -> float:
    started = time.perf_counter()
    hf_greedy(model, prompts, output_tokens)
    return time.perf_counter() - started


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: every `laneway` command imports this module.
    if not (args.model / "config.json").is_file():
        # transformers would take the name for a Hub repo id, and nothing is downloaded here.
        print(
            f"laneway bench-engine: no model folder at {args.model} (no config.json)",
            file=sys.stderr,
        )
        return 2
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(args.model)
    hf.eval()
    vocab = int(hf.config.vocab_size)
    engine = _engine(args.model)
    _run(engine, [_prompt(0, args.prompt_tokens, vocab)], 4, "warmup")
    _hf_generate(hf, [_prompt(0, args.prompt_tokens, vocab)], 4)
    results: dict[str, Any] = {"throughput": {}, "ttft": {}}
    print(f"{'concurrency':>11}  {'laneway tok/s':>13}  {'transformers tok/s':>18}  {'ratio':>6}")
    for c in args.concurrency or [1, 8, 32]:
        prompts = [_prompt(100 * c + i, args.prompt_tokens, vocab) for i in range(c)]
        total = c * args.output_tokens
        ours = total / _run(engine, prompts, args.output_tokens, f"c{c}")
        theirs = total / _hf_generate(hf, prompts, args.output_tokens)
        results["throughput"][c] = {"laneway": ours, "transformers": theirs, "ratio": ours / theirs}
        print(f"{c:>11}  {ours:>13.1f}  {theirs:>18.1f}  {ours / theirs:>6.2f}")
    long = _prompt(7, args.long_prompt_tokens, vocab)
    cold, _ = _ttft(engine, long, "cold")
    warm, cached = _ttft(engine, long, "warm")
    hf_s = _hf_generate(hf, [long], 1)
    results["ttft"] = {
        "prompt_tokens": len(long),
        "laneway_cold_s": cold,
        "laneway_cached_s": warm,
        "cached_tokens": cached,
        "transformers_s": hf_s,
    }
    print(
        f"TTFT, {len(long)}-token prompt: laneway cold {cold * 1000:.1f} ms, cached "
        f"{warm * 1000:.1f} ms ({cached} tokens from cache), transformers {hf_s * 1000:.1f} ms"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0
