"""The two line forms of a batch JSONL file, as pydantic models (jobs/batch_input.py reads them).

OpenAI Batch lines carry a chat completion body: `stop` and `seed` are honoured, `n` other than
1 and `top_p` other than 1 are refused (one completion per request, temperature sampling), other
body fields are ignored."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

CHAT_COMPLETIONS_URL = "/v1/chat/completions"
CustomId = Annotated[str, Field(min_length=1, max_length=256)]


class _Strict(BaseModel):
    """Types as written in the JSON: "5" is not a number, unknown fields are typos."""

    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)  # "name" and the like are ignored
    role: str
    content: str | list[TextPart]

    @field_validator("role")
    @classmethod
    def _one_user_turn(cls, role: str) -> str:
        if role not in ("system", "developer", "user"):
            raise ValueError(
                f"role {role!r} is not supported: ringq runs one user turn "
                "(system, developer and user messages only)"
            )
        return role

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(BaseModel):
    model_config = ConfigDict(strict=True)  # other OpenAI parameters are ignored
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    top_p: float | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(
                f"n={value}: ringq returns one completion per request; send the request "
                f"{value} times with their own custom_id (and seed) instead"
            )
        return value

    @field_validator("top_p", mode="before")
    @classmethod
    def _no_nucleus(cls, value: object) -> object:
        if value is not None and value != 1:
            raise ValueError(
                f"top_p={value} is not supported (sampling uses temperature only): "
                "remove it or set it to 1"
            )
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class OpenAILine(_Strict):
    custom_id: CustomId
    method: Literal["POST"]
    url: Literal["/v1/chat/completions"]
    body: ChatBody


class PlainLine(_Strict):
    custom_id: CustomId
    document: str | None = None
    document_path: str | None = None
    prompt: str | None = None
    kind: Literal["prefill", "generate"] = "generate"
    keep_cache: bool = False  # a prefill kept (pinned) as questions on its document start
    max_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None
    stop: list[str] = []
    seed: int | None = None

    @model_validator(mode="after")
    def _one_document(self) -> "PlainLine":
        if (self.document is None) == (self.document_path is None):
            raise ValueError("give exactly one of 'document' and 'document_path'")
        return self
