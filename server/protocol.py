"""Request bodies of the OpenAI API (and vLLM's /tokenize, /detokenize), validated at the edge.

Range checks live in the field declarations, so a bad value is a 400 that names the field.
A field the server does not implement (`best_of`, `suffix`, a misspelling) is a 400 naming it
too, at any depth, rather than a 200 that quietly ignores what the client asked for. A chat
message is the one exception: its other keys are handed to the chat template.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_STOP_STRINGS = 16
MAX_N = 128
MAX_CHOICES = 256
"""Choices one completions request may start: its prompts times n."""
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
"""Most entries in one request's logit_bias."""
_TOKEN_ID = re.compile("0|[1-9][0-9]{0,9}")
SEED_RANGE = (-(2**63), 2**63 - 1 - MAX_N)
"""torch generators take 64-bit seeds; choice i of n uses seed + i."""
_SURROGATE = re.compile("[\\ud800-\\udfff]")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether any string in decoded JSON holds a lone UTF-16 surrogate (iterative: bodies may
    nest deeper than Python's recursion limit)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # SDKs send `"n": null` and the like for parameters the caller left unset.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: Literal[False] = False
    """Chunks are never padded: asking for padding is refused."""


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    """Honoured or not, the schema is enforced: every token is masked by it."""


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        if self.type == "json_schema" and not schema:
            raise ValueError('type "json_schema" needs json_schema.schema')
        return self


class StructuredOutputs(_Strict):
    """vLLM's extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    """llguidance's Lark dialect (docs/STRUCTURED_OUTPUT.md)."""
    json_object: bool | None = None


class Speculation(_Strict):
    """Tandem's extension: this request's speculation."""

    method: str = "auto"
    """auto (the server's), off, or the server's own method's name (server/prompts.py checks)."""
    max_draft_tokens: int | None = Field(None, ge=0, strict=True)
    """A cap on K every step, at most the server's --max-draft-tokens (the engine checks)."""


class _TextBody(_Strict):
    """A request body whose text reaches the tokenizer: no lone surrogates anywhere in it."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON can escape a lone surrogate ("\ud800"); json.loads keeps it, but no tokenizer
        # takes it and no UTF-8 response can carry it (not even an error message quoting it).
        if _has_lone_surrogate(data):
            raise ValueError(
                "the body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
                "pair), which is not valid Unicode text"
            )
        return data


class SamplingRequest(_TextBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    """Token id (a decimal string, as JSON keys are) -> a bias in [-100, 100] added to its
    logit before sampling; the engine checks the ids against the vocabulary."""
    user: str | None = None
    """The caller's end user, for abuse monitoring at OpenAI: metadata that changes no output,
    accepted and ignored as vLLM does."""
    # Extensions (vLLM spells them the same way).
    top_k: int = Field(0, ge=-1, description="0 or -1 = no top-k cut")
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs' fields.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    speculation: Speculation | None = None
    """Tandem's own: per-request speculation control."""

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed (got {len(value)})")
        for key, bias in (value or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys must be token ids, written as integers (got {key!r})")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100] (got {bias} for token {key})")
        return value

    @property
    def logit_biases(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or not value:
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not isinstance(value[0], int) and len(value) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request (got {len(value)})")
        if isinstance(value[0], list) and any(not ids for ids in value):
            raise ValueError("token id prompts must not be empty")
        if isinstance(value[0], str) and any(not text for text in value):
            raise ValueError("prompts must not be empty strings")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list: one entry per prompt, text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"
    """JSON text, as the OpenAI API sends it."""


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow")
    """Keys beyond these reach the chat template as they are (server/prompts.py), as
    Hugging Face templates read them."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's earlier calls."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; None = no arguments."""
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class _TokenizerBody(_TextBody):
    """vLLM's /tokenize and /detokenize bodies. Unknown fields are refused (400 naming the
    field): these routes answer at once, so a misspelt option would go unnoticed otherwise."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None


class TokenizeCompletionRequest(_TokenizerBody):
    prompt: str
    add_special_tokens: bool = True
    """The tokenizer's BOS and the like, as /v1/completions adds them."""
    return_token_strs: bool = False


class TokenizeChatRequest(_TokenizerBody):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """End on the last message, left open (a prefill), instead of opening the assistant's turn."""
    add_special_tokens: bool = False
    """On top of what the chat template writes (which /v1/chat/completions does not do)."""
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(None, max_length=128)
    """Rendered as /v1/chat/completions renders them with tool_choice auto."""

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError(
                "continue_final_message needs add_generation_prompt false (the chat ends on "
                "either the last message or the assistant's opened turn)"
            )
        return value


class DetokenizeRequest(_TokenizerBody):
    tokens: list[Annotated[int, Field(strict=True)]]
