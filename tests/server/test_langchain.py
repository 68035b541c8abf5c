"""LangChain's ChatOpenAI against a real `prefixkv serve --enable-auto-tool-choice --tool-call-parser
hermes` subprocess, as a LangChain user would point it at vLLM: `with_structured_output(Model,
method="json_schema")` returns a valid object, `bind_tools` returns `tool_calls`, streaming works
(text and tool calls), and the server ends idle with every KV block free."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow


class Capital(BaseModel):
    """The capital city of a country."""

    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=16)


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def llm(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=server.base + "/v1",
        api_key="unused",
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=40,
        timeout=120,
    )


def test_structured_output_tools_and_streaming(server, llm):
    capital = llm.with_structured_output(Capital, method="json_schema").invoke(
        "What is the capital of France? Answer with the city and the country."
    )
    assert isinstance(capital, Capital) and capital.city

    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke("What is the weather in Paris?")
    assert [c["name"] for c in message.tool_calls] == ["GetWeather"]
    assert GetWeather(**message.tool_calls[0]["args"]).city

    chunks = list(llm.stream("Say hello.", max_tokens=6))
    assert len(chunks) > 2 and "".join(c.content for c in chunks).strip()
    streamed = None
    for chunk in bound.stream("What is the weather in Rome?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [c["name"] for c in streamed.tool_calls] == ["GetWeather"]
    server.wait_idle()
