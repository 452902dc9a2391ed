"""The OpenAI request bodies ds4 accepts (pydantic), with the checks OpenAI clients expect to be told about.

A top-level field ds4 does not know is refused, naming it (a typo or an unsupported option must not pass
silently), except OpenAI's bookkeeping fields that change nothing about the output (`user`, `metadata`,
`store`, ...), which are accepted and ignored. Nested objects (tools, response_format) ignore unknown keys,
as OpenAI's own schemas grow there. Fields ds4 cannot honour (best_of > n, suffix) are refused with a message.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Most choices one request may ask for (prompts x n): one request must not flood the engine's queue.
MAX_CHOICES = 1024
# Seeds torch's generators take: int64 and uint64 values (a negative seed is its two's complement).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(BaseModel):
    """A whole request body: unknown top-level fields are errors."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    # OpenAI bookkeeping, accepted and ignored.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class StreamOptions(_Part):
    include_usage: bool = False


class JsonSchemaFormat(_Part):
    name: str = "response"
    # `schema` is a BaseModel attribute name, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self


class FunctionDefinition(_Part):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"] = "function"
    function: NamedFunction


class _Sampling(_Body):
    """Sampling fields shared by chat and completions (OpenAI names, vLLM extras)."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of not in (None, n):
            raise ValueError(
                f"best_of={best_of} with n={n} is not supported: ds4 returns every choice it generates "
                "(ask for n choices instead)"
            )
        return best_of

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    def choice_seed(self, index: int) -> int | None:
        """Choice `index` of a prompt samples with seed + index, so each choice is reproducible on its own."""
        return None if self.seed is None else (self.seed + index) % 2**64


class ChatCompletionRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top_logprobs

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, tool_choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if tool_choice not in (None, "none", "auto") and not tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(tool_choice, NamedToolChoice):
            names = [tool.function.name for tool in tools]
            if tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {tool_choice.function.name!r}, which is not in tools {names}")
        return tool_choice

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 is allowed: with echo it asks for the prompt (and its logprobs) only.
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, prompt: Any) -> Any:
        # One message for every wrong shape, instead of one per member of the union.
        many = isinstance(prompt, list) and prompt and not _is_token_ids(prompt)
        prompts = prompt if many else [prompt]
        if not (all(isinstance(p, str) for p in prompts) or all(_is_token_ids(p) for p in prompts)):
            raise ValueError("must be a string, a list of token ids, a list of strings or a list of token-id lists")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("is empty" if not many else "holds an empty prompt")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @model_validator(mode="after")
    def _bounded_choices(self) -> CompletionRequest:
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(
                f"{len(self.prompts)} prompts x n={self.n} asks for more than {MAX_CHOICES} choices in one request"
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per entry: a text or a list of token ids."""
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Body):
    prompt: str | None = None
    # For a prompt: whether to put BOS in front (as /v1/completions does); chat messages carry their own.
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    tokens: list[int]
