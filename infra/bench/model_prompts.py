"""What a model folder allows a live replay's token-id prompts (``--engine vllm``): the ids must
be ordinary tokens of its vocabulary, and prompt and output must fit its context."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from infra.bench.traces import TraceRequest, capped, check_token_ids


def model_context(model_dir: Path) -> int:
    """The most positions, prompt and output together, the model's config allows."""
    config = json.loads((model_dir / "config.json").read_text())
    return int(config["max_position_embeddings"])


def check_model_vocabulary(model_dir: Path) -> None:
    """ValueError unless the model takes the trace prompts' token ids as ordinary tokens: below
    both its tokenizer's size (what the ingress checks ids against) and its embedding's, and
    none of its special tokens."""
    # Imported here: an offline replay, or a sim's, never reads a tokenizer.
    from tokenizers import Tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if isinstance(config.get("vocab_size"), int):
        vocab = min(vocab, config["vocab_size"])
    special = [i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special]
    check_token_ids(vocab, special)


def fit_to_model(
    trace: Sequence[TraceRequest], model_dir: Path, max_prompt: int | None
) -> list[TraceRequest]:
    """``trace`` with prompts cut to ``max_prompt`` tokens, or, None, to what the model's
    context holds beside the longest output; ValueError if not even one token fits."""
    longest_output = max((r.output_length for r in trace), default=0)
    room = model_context(model_dir) - longest_output
    if max_prompt is None:
        max_prompt = room
    if max_prompt < 1 or max_prompt > room:
        raise ValueError(
            f"prompts of {max_prompt} tokens and outputs of {longest_output} do not fit the "
            f"model's {model_context(model_dir)} positions (--max-prompt-tokens, "
            "--max-output-tokens)"
        )
    return capped(trace, max_prompt, None)
