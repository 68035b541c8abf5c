"""Structured outputs on the OpenAI routes: OpenAI's `response_format` (`text`, `json_object`,
`json_schema`) and vLLM's `structured_outputs` extra field, turned into the engine's
`StructuredOutputsParams`. The grammar itself is compiled in a worker thread before the request
reaches the engine loop (OpenAIServing.compile_grammar)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..constraints import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema is under `schema` (`json_schema` as vLLM
    also reads it)."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def structured_outputs_of(
    response_format: ResponseFormat | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutputsParams | None:
    """The request's constraint, or None. ValueError (-> 400) naming what is wrong."""
    if structured_outputs is not None:
        if response_format is not None and response_format.type != "text":
            raise ValueError("send either response_format or structured_outputs, not both")
        if not isinstance(structured_outputs, dict):
            raise ValueError("structured_outputs must be an object")  # noqa: TRY004
        try:
            return StructuredOutputsParams(**structured_outputs)
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}".replace("StructuredOutputsParams.__init__() ", "")) from None
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema.json_schema if response_format.json_schema is not None else None
    if schema is None:
        raise ValueError('response_format of type "json_schema" needs json_schema.schema')
    return StructuredOutputsParams(json=schema)
