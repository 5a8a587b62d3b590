"""``HfTokenizer`` over the tiny model's byte-level BPE: round trips, streaming, chat templates."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import processors

from services.common.hf_tokenizer import HfTokenizer
from services.common.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.engine.torch_engine._support import Message

MIXED = "Ferry café, naïve 😀 日本語 — ✓ tabs\tand\nnewlines, 12,345 and <b>&amp;</b>"


@pytest.fixture(scope="module")
def tokenizer(made_model: Path) -> HfTokenizer:
    return HfTokenizer(made_model)


def _copy_with(made_model: Path, target: Path, **config_changes: object) -> Path:
    """A copy of the tiny model whose tokenizer_config has ``config_changes`` (None deletes)."""
    shutil.copytree(made_model, target)
    path = target / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return target


def _stream(tokenizer: HfTokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    decoder = tokenizer.stream_decoder()
    pieces, at = [], 0
    for size in chunks:
        pieces.append(decoder.decode(ids[at : at + size]))
        at += size
    pieces.append(decoder.flush())
    return pieces


def test_round_trip_of_mixed_text(tokenizer: HfTokenizer) -> None:
    ids = tokenizer.encode(MIXED)
    assert tokenizer.decode(ids) == MIXED
    assert all(0 <= t < tokenizer.vocab_size for t in ids)
    # Trained merges make common words single tokens: far fewer ids than bytes.
    assert len(tokenizer.encode("the river and the ferry")) < len("the river and the ferry") // 2


def test_special_tokens_encode_as_one_id_and_are_skipped_in_text(tokenizer: HfTokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == tokenizer.eos_token_id == 2
    assert tokenizer.decode(ids) == "user\nhi"


def test_stream_decoder_token_by_token_equals_full_decode(tokenizer: HfTokenizer) -> None:
    ids = tokenizer.encode(MIXED)
    pieces = _stream(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == tokenizer.decode(ids) == MIXED
    # Multi-byte characters span several byte-level tokens; none is ever emitted half done.
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[-1] == ""


def test_the_workers_detokenizer_cuts_stop_strings_over_it(tokenizer: HfTokenizer) -> None:
    protocol: Tokenizer = tokenizer
    detok = IncrementalDetokenizer(protocol, stop=["ferry"])
    ids = tokenizer.encode("The café by the ferry house")
    text = "".join(detok.push([t]) for t in ids)
    assert detok.stopped and text == "The café by the "


def test_stream_decoder_equals_full_decode_for_arbitrary_ids(tokenizer: HfTokenizer) -> None:
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 24))]
        chunks: list[int] = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 3))
        # Random ids include broken UTF-8 and special tokens: the stream must still add up.
        assert "".join(_stream(tokenizer, ids, chunks)) == tokenizer.decode(ids)


def test_stream_decoder_holds_an_incomplete_character_until_flush(
    tokenizer: HfTokenizer,
) -> None:
    ids = tokenizer.encode("日")
    assert len(ids) > 1  # one character, several byte tokens
    decoder = tokenizer.stream_decoder()
    assert decoder.decode(ids[:-1]) == ""
    assert decoder.flush() == tokenizer.decode(ids[:-1])  # what is left, replacement and all


def test_chat_template_renders_chatml_with_generation_prompt(tokenizer: HfTokenizer) -> None:
    messages = [Message("system", "Be brief."), Message("user", "Where is the ferry?")]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhere is the ferry?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(prompt)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_template_from_tokenizer_config_is_honoured(made_model: Path, tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] "
        "{{ m['content'] | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ eos_token }}"
    )
    model = _copy_with(made_model, tmp_path / "custom", chat_template=template)
    rendered = HfTokenizer(model).apply_chat_template([Message("user", 'say "<hi>" & go')])
    # tojson must not HTML-escape, as transformers' does not.
    assert rendered == '<|endoftext|>[USER] "say \\"<hi>\\" & go"\n[ASSISTANT]<|im_end|>'


def test_named_templates_and_the_jinja_file(made_model: Path, tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    model = _copy_with(made_model, tmp_path / "named", chat_template=named)
    assert HfTokenizer(model).apply_chat_template([Message("user", "x")]) == "plain"
    (model / "chat_template.jinja").write_text("from the file")
    assert HfTokenizer(model).apply_chat_template([Message("user", "x")]) == "from the file"


def test_chatml_fallback_and_eos_from_model_config(made_model: Path, tmp_path: Path) -> None:
    model = _copy_with(made_model, tmp_path / "bare", chat_template=None, eos_token=None)
    tokenizer = HfTokenizer(model)
    assert tokenizer.apply_chat_template([Message("user", "hi")]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token_id == json.loads((model / "config.json").read_text())["eos_token_id"]


def test_templates_run_sandboxed_and_can_refuse(made_model: Path, tmp_path: Path) -> None:
    refusing = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    model = _copy_with(made_model, tmp_path / "refusing", chat_template=refusing)
    with pytest.raises(TemplateError, match="user first"):
        HfTokenizer(model).apply_chat_template([Message("assistant", "hi")])
    escaping = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    model = _copy_with(made_model, tmp_path / "escaping", chat_template=escaping)
    with pytest.raises(TemplateError):
        HfTokenizer(model).apply_chat_template([Message("user", "hi")])


def test_bos_is_not_doubled_when_the_prompt_carries_it(made_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "with-bos"
    shutil.copytree(made_model, model)
    rust = RustTokenizer.from_file(str(model / "tokenizer.json"))
    # A Llama-style tokenizer that prepends <|endoftext|> (id 0) to everything it encodes.
    rust.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    rust.save(str(model / "tokenizer.json"))
    tokenizer = HfTokenizer(model)
    assert tokenizer.encode("hi")[0] == 0
    assert tokenizer.encode("<|endoftext|>hi") == tokenizer.encode("hi")
