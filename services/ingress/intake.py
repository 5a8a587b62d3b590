"""A parsed OpenAI request made into the RequestSpec the cluster serves: the served-model check,
the prompt's tokens (a chat's messages through the model's chat template), the token budget and
the prompt's chained block hashes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from schemas.block_hash import chain_block_hashes, salt_root
from schemas.cache_salt import adapter_salt, request_salt
from schemas.events import RequestSpec, SamplingParams
from schemas.trusted import trusted
from services.common.tokenizer import Tokenizer
from services.ingress.adapters import Adapters
from services.ingress.context_limit import WorkerContextLimit
from services.ingress.errors import InvalidRequest, model_not_found
from services.ingress.openai_models import ChatRequest, ParsedRequest
from services.ingress.settings import IngressApiSettings
from services.ingress.worker_features import WorkerFeatures


class Intake:
    def __init__(
        self,
        tokenizer: Tokenizer,
        settings: IngressApiSettings,
        worker_limit: WorkerContextLimit,
        features: WorkerFeatures | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        """``features``: what the registered workers can do (none: no worker known to lack
        anything; their engines refuse what they cannot do); ``adapters``: the LoRA adapters
        loaded (none: no adapters)."""
        self._tokenizer = tokenizer
        self._settings = settings
        self._worker_limit = worker_limit
        self._features = features or WorkerFeatures()
        self._models = frozenset(settings.served_model_names)
        self._adapters = adapters or Adapters()

    def spec(
        self, request: ParsedRequest, tenant: str | None = None, group_salt: str | None = None
    ) -> RequestSpec:
        """``tenant``: whose API key the request came with, ``group_salt``: the salt of that
        key's cache group (both none: the API takes no keys)."""
        params = request.params
        model, adapter = params.model, None
        if model not in self._models:
            # An adapter's requests are its base model's, which runs them with the adapter.
            adapter = self._adapters.find(model)
            if adapter is None or adapter.base_model not in self._models:
                raise model_not_found(model)
            model = adapter.base_model
            self._features.check_adapters(model)
        self._features.check_structured(model, params.structured_output)
        self._features.check_logprobs(model, params.logprobs)
        prompt_ids = self._prompt_ids(request)
        prompt_len = len(prompt_ids)
        if not prompt_len:
            raise InvalidRequest("The prompt must contain at least one token.", "prompt")
        settings = self._settings
        limit = self._max_model_len(model)
        max_tokens = params.max_tokens
        if max_tokens is None:
            room = settings.default_max_tokens if limit is None else limit - prompt_len
            max_tokens = max(1, min(settings.default_max_tokens, room))
        # No limit known (no worker registered one yet): the request goes on, and an engine
        # refuses what it cannot hold.
        if limit is not None and prompt_len + max_tokens > limit:
            where = request.prompt_param
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. "
                f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                f"{where}, {max_tokens} in the completion). Please reduce the length of the "
                f"{where} or completion.",
                where,
                code="context_length_exceeded",
            )
        # Copied only now that it is known to fit: an over-long prompt costs one list, not two.
        prompt_ids = tuple(prompt_ids)
        # Every field was checked above, so pydantic's validation would only cost time here.
        sampling = trusted(SamplingParams, {
            "max_tokens": max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "seed": params.seed, "stop": params.stop, "stop_token_ids": params.stop_token_ids,
            "ignore_eos": params.ignore_eos, "offset": 0, "logprobs": params.logprobs,
            "structured_output": params.structured_output,
        })  # fmt: skip
        lora = None if adapter is None else adapter.name
        salt = adapter_salt(request_salt(group_salt, params.cache_salt), lora)
        return trusted(RequestSpec, {
            "model": model, "prompt_token_ids": prompt_ids, "prompt_tokens": None,
            "block_size": settings.block_size,
            "block_hashes": chain_block_hashes(prompt_ids, settings.block_size, salt_root(salt)),
            "sampling": sampling, "reply_to": settings.instance_id,
            "deadline": datetime.now(UTC) + timedelta(seconds=settings.request_timeout_s),
            "tenant": tenant, "attempt": 0, "priority": "normal", "cache_salt": salt,
            "lora": lora,
            "lora_path": None if adapter is None else adapter.path, "avoid_workers": (),
        })  # fmt: skip

    def _max_model_len(self, model: str) -> int | None:
        limits = (self._settings.max_model_len, self._worker_limit.tokens(model))
        return min((n for n in limits if n is not None), default=None)

    def _prompt_ids(self, request: ParsedRequest) -> Sequence[int]:
        tokenizer = self._tokenizer
        if isinstance(request, ChatRequest):
            return tokenizer.encode(tokenizer.apply_chat_template(request.messages))
        prompt = request.prompt
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        vocab_size = tokenizer.vocab_size
        if not all(0 <= t < vocab_size for t in prompt):
            raise InvalidRequest(f"Token ids must be in [0, {vocab_size}).", "prompt")
        return prompt
