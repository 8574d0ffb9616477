"""The OpenAI wire format the server speaks (the subset vLLM, SGLang and MLC-LLM answer alike).

Requests are validated here: a field of the wrong type, out of range or asking for something this
server does not do (n > 1, logprobs, penalties) is a 400 naming the field.  Unknown fields are
ignored, as OpenAI's own server and vLLM's do, so stock clients that send extra options work.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specpilot.core.sampling import MAX_SEED, SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)          # vLLM's extension; -1 and 0: no cut
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stop: str | list[str] | None = Field(None, validate_default=True)   # made a list
    n: int = Field(1, ge=1, le=1)
    logprobs: None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    return_token_ids: bool = False                  # vLLM's extension: the tokens beside the text

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 8 or any(not s for s in stops):
            raise ValueError("at most 8 non-empty stop strings")
        return stops

    def sampling(self, default_seed: int) -> SamplingParams | None:
        """None for greedy decoding (temperature 0, OpenAI's default of 1 otherwise)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature == 0.0:
            return None
        return SamplingParams(temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=max(self.top_k or 0, 0), seed=default_seed if self.seed is None else self.seed)


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = Field(False, le=False)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: str | None, tokens: list[int], prompt_len: int,
               with_ids: bool, chunk: bool = False) -> dict:
    """A text completion, or one streamed chunk of it (``tokens``: the chunk's)."""
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if with_ids:
        choice["token_ids"] = tokens
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
    if not chunk:
        body["usage"] = usage(prompt_len, len(tokens))
    return body


def chat(rid: str, model: str, text: str, finish: str | None, tokens: list[int], prompt_len: int,
         with_ids: bool, chunk: bool = False, first: bool = False) -> dict:
    """A chat completion, or one streamed chunk of it (the first carries the role)."""
    if chunk:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None}
        kind = "chat.completion"
    if with_ids:
        choice["token_ids"] = tokens
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    if not chunk:
        body["usage"] = usage(prompt_len, len(tokens))
    return body


def error(message: str, status: int, kind: str = "BadRequestError", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
