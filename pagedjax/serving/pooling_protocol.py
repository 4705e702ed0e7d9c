"""The wire format of the pooling endpoints (vLLM's; OpenAI's /v1/embeddings): request bodies,
parsed strictly with unknown fields refused by name as the generation bodies are, and the
encodings of their vectors (encoding_format float / base64, vLLM's embed_dtype and
endianness)."""

from __future__ import annotations

import base64
import sys
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pagedjax.serving.protocol import MAX_PROMPTS, PRIORITY_REFUSAL, ChatMessage, Identifier

EMBED_DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16,
                                "bfloat16": "bfloat16"}


class _PoolingFields(BaseModel):
    """What every pooling body carries (vLLM's PoolingBasicRequestMixin)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    user: Identifier = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's: 0 unless priority scheduling is on (it is not here: refused otherwise)
    priority: int = 0
    request_id: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    mm_processor_kwargs: dict | None = None  # multimodal only: refused when given

    def unsupported(self) -> list[tuple[str, str]]:
        found = []
        if self.priority != 0:
            found.append(("priority", PRIORITY_REFUSAL))
        if self.mm_processor_kwargs:
            found.append(("mm_processor_kwargs", "this server serves text models: there is no "
                          "multimodal processor"))
        return found


class _InputFields(BaseModel):
    """A pooled text: `input` (text or token ids, one or a list), or vLLM's chat form,
    `messages` rendered by the chat template (one conversation)."""

    input: str | list | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    # None: the form's default (true for input, false for messages: the template's own)
    add_special_tokens: bool | None = None

    def input_errors(self) -> list[tuple[str, str]]:
        if (self.input is None) == (self.messages is None):
            return [("input", "give input (text or token ids) or messages (a conversation), "
                     "one of them")]
        if self.messages is None:
            chat = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
            given = [f for f in chat if getattr(self, f) not in (None, False)]
            return [(given[0], f"{given[0]} goes with messages")] if given else []
        if self.add_special_tokens:
            return [("add_special_tokens", "a conversation's special tokens are the chat "
                     "template's; only false is supported")]
        if self.continue_final_message and self.add_generation_prompt:
            return [("continue_final_message", "continue_final_message and "
                     "add_generation_prompt cannot both be true")]
        return []


class _ActivationFields(BaseModel):
    """A head's activation: use_activation, and vLLM's older names for it (softmax,
    activation), which must agree with it when several are given."""

    use_activation: bool | None = None
    softmax: bool | None = None
    activation: bool | None = None

    def chosen_activation(self) -> tuple[bool | None, str | None]:
        """(the activation asked for, or None; the field of a disagreement, or None)."""
        given = {f: getattr(self, f) for f in ("use_activation", "softmax", "activation")
                 if getattr(self, f) is not None}
        if len(set(given.values())) > 1:
            return None, sorted(given)[0]
        return (next(iter(given.values())) if given else None), None


class _EncodedFields(BaseModel):
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"


class EmbeddingRequest(_PoolingFields, _InputFields, _EncodedFields):
    """POST /v1/embeddings: OpenAI's fields (input, encoding_format, dimensions, user) and
    vLLM's (normalize, add_special_tokens, truncate_prompt_tokens, messages, ...)."""

    dimensions: int | None = None
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest, _ActivationFields):
    """POST /pooling: any pooling task's raw data (vLLM's; task defaults to the model's)."""

    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None


class ClassificationRequest(_PoolingFields, _InputFields, _ActivationFields):
    """POST /classify."""


class ScoreRequest(_PoolingFields, _ActivationFields):
    """POST /score (and /v1/score): text_1 against text_2, one to many or pairwise."""

    text_1: str | list[str] = Field(...)
    text_2: str | list[str] = Field(...)


class RerankRequest(_PoolingFields, _ActivationFields):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape)."""

    query: str
    documents: list[str | dict] = Field(..., min_length=1)
    top_n: int = Field(default=0, ge=0)
    return_documents: bool = True


def split_inputs(value: str | list) -> list[str | list[int]]:
    """An input field's prompts: a string, token ids, or a list of either; ValueError."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise ValueError("input must be non-empty (a string, token ids, or a list of them)")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    if not all(isinstance(v, str) or (isinstance(v, list) and v and all(
            isinstance(t, int) and not isinstance(t, bool) for t in v)) for v in value):
        raise ValueError("input must be a string, a list of strings, token ids, or a list of "
                         "token-id lists (none empty)")
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"input holds {len(value)} items, more than {MAX_PROMPTS}")
    if any(len(v) == 0 for v in value):
        raise ValueError("input must not hold an empty string")
    return list(value)


def encoded(vector: np.ndarray, body: _EncodedFields) -> list | str:
    """A vector as the body asks: a list of floats, or base64 of its bytes in embed_dtype and
    endianness (OpenAI's base64: little-endian float32, what its client decodes)."""
    vector = np.asarray(vector, np.float32)
    if body.encoding_format == "float":
        return vector.tolist()
    dtype = EMBED_DTYPES[body.embed_dtype]
    if dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    data = vector.astype(dtype)
    order = sys.byteorder if body.endianness == "native" else body.endianness
    if order != sys.byteorder:
        data = data.byteswap()
    return base64.b64encode(data.tobytes()).decode("ascii")
