"""Request bodies of MEPIC's own endpoints (the chunk API), as vLLM keeps its in ``protocol``."""

from pydantic import BaseModel, Field, model_validator

from ascend_mepic.vllm_integration.openai_api import validate_cache_salt


class ChunkCreate(BaseModel):
    """``POST /v1/chunks``: a chunk as text (tokenized alone) or as token ids."""

    text: str | None = None
    token_ids: list[int] | None = Field(default=None, min_length=1)
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> "ChunkCreate":
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of 'text' and 'token_ids'")
        validate_cache_salt(self.cache_salt)
        return self
