"""The embedded engine's wire format: OpenAI / vLLM request schemas and error bodies.

Request bodies accept unknown fields (OpenAI clients send many we ignore); every bad
request becomes an :class:`APIError` answered as ``{"error": {message, type, param,
code}}`` with a 4xx status; an over-long prompt gets code ``context_length_exceeded``.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentrl.errors import RequestError


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingBody(_Body):
    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _none_is_default(cls, v, info):
        return {"temperature": 1.0, "top_p": 1.0}[info.field_name] if v is None else v

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, v):
        # as vLLM (its _SAMPLING_EPS): far smaller ones divide float32 logits to inf (μ NaN) or are 0 in float32
        return 0.0 if v < 1e-5 else v


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- errors


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def from_request_error(e: RequestError) -> APIError:
    return APIError(400, str(e), param=e.param, code=e.code)

