"""Request bodies of MEPIC's own endpoints (the chunk API), as vLLM keeps its in ``protocol``."""

from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from ascend_mepic.vllm_integration.openai_api import CompletionRequest, validate_cache_salt


class MepicCompletionRequest(CompletionRequest):
    """vLLM's completion request, whose prompt may also be a list of pieces (strings and
    ``{"text", "mepic"}`` objects, ``chunk_parts.completion_pieces``): one prompt whose chunks
    are named beside the text, in the spirit of chat content parts."""

    prompt: (
        list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | str
        | list[str]
        | list[str | dict[str, Any]]
        | None
    ) = None


class ChunkCreate(BaseModel):
    """``POST /v1/chunks``: a chunk as text (tokenized alone) or as token ids; optionally the
    prompt before the first chunk of the requests that will use it (``prefix`` text, tokenized
    as a completion prompt's text is, BOS included unless ``add_special_tokens`` is false, or
    ``prefix_token_ids``), which anchored compiles compile the chunk after."""

    text: str | None = None
    token_ids: list[int] | None = Field(default=None, min_length=1)
    cache_salt: str | None = None
    prefix: str | None = Field(default=None, min_length=1)
    prefix_token_ids: list[int] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_source(self) -> "ChunkCreate":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' and 'token_ids'")
        if self.prefix is not None and self.prefix_token_ids is not None:
            raise ValueError("give at most one of 'prefix' and 'prefix_token_ids'")
        validate_cache_salt(self.cache_salt)
        return self
