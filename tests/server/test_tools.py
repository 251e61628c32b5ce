"""Tool calling: each family's format read back and forced by its grammar, the stream that never shows
a call as text, the 400s, and on the embedded model with real clients (the openai SDK, LangChain's
``bind_tools``) a round trip whose calls validate against their tools' schemas.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from tests.helpers import byte_tokenizer
from tests.server.live import MODEL, LiveServer, tiny_engine
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.models.loading.loader import LoadedModel
from tidespec.sampling import StructuredOutputs
from tidespec.server.app import ServerConfig, create_app
from tidespec.server.tools.protocol import NamedToolChoice, Tool, ToolRequestError, plan_tools
from tidespec.server.tools.stream import ToolStream
from tidespec.structured.grammar import JSON_OPTIONS, GrammarCompiler
from tidespec.structured.tool_calls import REGISTRY, HermesParser, Llama3JsonParser, MistralParser, ToolSpec, parser_for

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SPECS = [ToolSpec("get_weather", WEATHER), ToolSpec("get_time", TIME)]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}


@pytest.mark.parametrize("parser,text,content", [
    (HermesParser(), f'Let me see.<tool_call>\n{json.dumps(CALL)}\n</tool_call>', "Let me see."),
    (HermesParser(), f"<tool_call>\n[{json.dumps(CALL)}]\n</tool_call>", None),  # SmolLM2's list form
    (HermesParser(), f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_w", None),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None),
    (MistralParser(), f"[TOOL_CALLS][{json.dumps(CALL)}]", None),
    (MistralParser(), f"[{json.dumps(CALL)}]", None),  # the special token left out of the text
])
def test_each_format_is_read_back_into_calls(parser, text, content) -> None:
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", CALL["arguments"])]


@pytest.mark.parametrize("parser", list(REGISTRY.values()))
def test_text_that_is_no_call_stays_text(parser) -> None:
    for text in ("The weather is fine.", "<tool_call>\nnot json\n</tool_call>", "{not json", "[TOOL_CALLS] oops"):
        assert parser.parse(text).calls == [] and parser.parse(text).content == text


def test_parsers_are_chosen_by_name_or_from_the_template() -> None:
    assert isinstance(parser_for("auto", "...{{ '<tool_call>' }}..."), HermesParser)
    assert isinstance(parser_for("auto", "...[TOOL_CALLS]..."), MistralParser)
    assert isinstance(parser_for("auto", "...<|python_tag|>..."), Llama3JsonParser)
    assert parser_for("auto", "{{ messages }}") is None
    assert isinstance(parser_for("mistral", None), MistralParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'x'"):
        parser_for("x", None)


@pytest.mark.parametrize("parser,good,bad", [
    (HermesParser(), f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}\n</tool_call>'),
    (Llama3JsonParser(), '{"name": "get_time", "parameters": {"timezone": "UTC"}}',
     '{"name": "get_tme", "parameters": {"timezone": "UTC"}}'),
    (MistralParser(), f"[TOOL_CALLS][{json.dumps(CALL)}]", '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]'),
])
def test_each_grammar_admits_a_valid_call_and_nothing_else(parser, good, bad) -> None:
    """The grammar a required tool_choice runs: a call the parser reads, its arguments per the schema."""
    tok = byte_tokenizer()
    c = GrammarCompiler(tok, len(tok), [0])
    spec = StructuredOutputs(grammar=parser.grammar(SPECS, False, JSON_OPTIONS["compact"]))
    for text, ok in ((good, True), (bad, False)):
        m = c.matcher(spec)
        ids = tok.encode(text)
        consumed = m._m.try_consume_tokens(ids)
        assert (consumed == len(ids) and m._m.is_accepting()) == ok, (parser.name, text)


def test_plan_tools_refuses_what_it_cannot_serve() -> None:
    tools = [Tool.model_validate(t) for t in TOOLS]
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(tools, NamedToolChoice.model_validate(named), None, HermesParser(), {})
    assert plan.constraint is not None and '"get_time"' not in plan.constraint.grammar
    assert plan_tools(tools, "auto", None, HermesParser(), {}).constraint is None
    assert plan_tools(tools, "none", None, None, {}).parser is None
    for args, param in (((tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}),
                          None, HermesParser(), {}), "tool_choice"),
                        ((None, "required", None, HermesParser(), {}), "tool_choice"),
                        ((tools, "auto", None, None, {}), "tools")):
        with pytest.raises(ToolRequestError) as err:
            plan_tools(*args)
        assert err.value.param == param


def test_the_stream_holds_back_only_what_could_become_a_call() -> None:
    s = ToolStream(HermesParser())
    assert s.feed("Let me check. <tool") == "Let me check. "
    assert s.feed("_call>\n" + json.dumps(CALL)) == ""
    assert s.feed("\n</tool_call>") == ""
    rest, parsed = s.finish()
    assert rest == "" and parsed.content == "Let me check." and parsed.calls[0].name == "get_weather"
    s = ToolStream(HermesParser())
    assert s.feed("a <to") == "a " and s.feed("day") == "<today" and s.finish() == ("", s.finish()[1])
    s = ToolStream(Llama3JsonParser())
    assert s.feed("  ") == "" and s.feed("Hello") == "  Hello"
    s = ToolStream(Llama3JsonParser())
    assert s.feed('{"name": "get_time", ') == "" and s.finish()[0] == '{"name": "get_time", '


def test_tools_on_a_template_without_them_and_on_completions_are_400s() -> None:
    with TestClient(create_app(tiny_engine(), ServerConfig(served_model_name=MODEL))) as c:
        base = {"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json={**base, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        r = c.post("/v1/chat/completions", json={**base, "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200  # the tools are not used
        r = c.post("/v1/chat/completions", json={**base, "tool_choice": {"type": "function",
                                                                        "function": {"name": "x"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "t5", "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        # a tool loop's history is accepted (this template ignores the calls)
        history = [{"role": "user", "content": "t5"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "t6"}]
        assert c.post("/v1/chat/completions", json={**base, "messages": history}).status_code == 200


# ----------------------------------------------------------------------------- embedded model, real clients
@pytest.fixture(scope="module")
def server(embedded: LoadedModel):
    engine = build_engine(EngineConfig(cache=CacheConfig(max_model_len=2048, max_num_seqs=4),
                                       spec=SpecConfig(drafter="suffix", num_speculative_tokens=6)),
                          model=embedded.model, tokenizer=embedded.tokenizer)
    with LiveServer(create_app(engine, ServerConfig(served_model_name="smollm2"))) as s:
        yield s


@pytest.mark.integration
def test_openai_sdk_required_and_named_calls_validate_and_stream_alike(server: LiveServer) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        kw = {"model": "smollm2", "messages": msgs, "tools": TOOLS, "tool_choice": choice, "max_tokens": 80,
              "temperature": 0, "parallel_tool_calls": False}
        done = c.chat.completions.create(**kw)
        calls = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        schema = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)
        if isinstance(choice, dict):
            assert calls[0].function.name == "get_time"
        names, args, finish = {}, {}, None
        for ch in c.chat.completions.create(**kw, stream=True):
            for choice_delta in ch.choices:
                finish = choice_delta.finish_reason or finish
                assert not choice_delta.delta.content
                for d in choice_delta.delta.tool_calls or []:
                    names[d.index] = names.get(d.index, "") + (d.function.name or "")
                    args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        assert finish == "tool_calls" and names == {0: calls[0].function.name}
        assert args == {0: calls[0].function.arguments}


@pytest.mark.integration
def test_langchain_bind_tools_round_trip(server: LiveServer) -> None:
    """LangChain's ChatOpenAI against the server: a forced call of one of two tools, with arguments
    that validate; then the tool's result sent back, which the server renders and answers."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather of a city, in celsius or fahrenheit."""
        return f"18 degrees {unit} and sunny in {city}"

    @tool
    def get_time(timezone: str) -> str:
        """Current time in a timezone."""
        return "12:00"

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="smollm2", temperature=0, max_tokens=80,
                     max_retries=0)
    messages = [HumanMessage("What is the weather in Paris? Use celsius.")]
    ai = llm.bind_tools([get_weather, get_time], tool_choice="get_weather", parallel_tool_calls=False).invoke(messages)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(ai.tool_calls[0]["args"], get_weather.args_schema.model_json_schema())
    result = get_weather.invoke(ai.tool_calls[0]["args"])
    messages += [ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.bind_tools([get_weather, get_time]).invoke(messages)
    assert answer.content or answer.tool_calls
    assert answer.usage_metadata["input_tokens"] > ai.usage_metadata["input_tokens"]  # the result was rendered
    with pytest.raises(openai.BadRequestError):
        llm.bind_tools([get_weather], tool_choice="get_time").invoke(messages[:1])
