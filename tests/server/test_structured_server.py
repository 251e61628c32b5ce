"""Structured outputs against a live server with real clients, on the embedded model.

The openai SDK's ``chat.completions.parse`` with a pydantic model (``response_format`` json_schema)
returns a parsed object; vLLM's ``structured_outputs`` and ``guided_*`` fields (sent as the SDK's
``extra_body``, as vLLM's users do) constrain completions; every output validates against its schema
(``jsonschema``); a constraint the grammar library refuses is a 400 naming the field, and a request
in flight beside it is not affected.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.live import LiveServer, stream_text
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.llm import build_engine
from tidespec.models.loading.loader import LoadedModel
from tidespec.server.app import ServerConfig, create_app

MODEL = "smollm2"


class City(BaseModel):
    city: str
    country: str
    population_millions: float


@pytest.fixture(scope="module")
def server(embedded: LoadedModel):
    engine = build_engine(EngineConfig(cache=CacheConfig(max_model_len=1024, max_num_seqs=4),
                                       spec=SpecConfig(drafter="suffix", num_speculative_tokens=4)),
                          model=embedded.model, tokenizer=embedded.tokenizer)
    with LiveServer(create_app(engine, ServerConfig(served_model_name=MODEL))) as s:
        yield s


@pytest.mark.integration
def test_openai_sdk_parse_returns_a_parsed_object_that_validates(server: LiveServer) -> None:
    c = server.client()
    msgs = [{"role": "user", "content": "Paris is the capital of France and has about 2.1 million people. "
                                        "Give the city, its country and its population in millions as JSON."}]
    done = c.chat.completions.parse(model=MODEL, messages=msgs, response_format=City, max_tokens=80, temperature=0)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city
    jsonschema.validate(json.loads(done.choices[0].message.content), City.model_json_schema())
    # streamed: the same text, chunk by chunk
    schema_format = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema(),
                                                            "strict": True}}
    text, finish, _ = stream_text(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, temperature=0,
                                                            response_format=schema_format, stream=True), chat=True)
    assert text == done.choices[0].message.content and finish == "stop"


@pytest.mark.integration
def test_json_object_and_vllm_fields_constrain_the_output(server: LiveServer) -> None:
    c = server.client()
    obj = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                                    max_tokens=48, temperature=0, response_format={"type": "json_object"})
    content = obj.choices[0].message.content
    assert content.lstrip().startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    choice = c.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    phone = c.completions.create(model=MODEL, prompt="Call me at", max_tokens=16, temperature=0.8, seed=3,
                                 extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.choices[0].text)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    person = c.completions.create(model=MODEL, prompt="Ann is 31 years old. As JSON:", max_tokens=40, temperature=0,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(person.choices[0].text), schema)


@pytest.mark.integration
def test_a_refused_constraint_is_a_400_naming_its_field_and_nothing_else_is_affected(server: LiveServer) -> None:
    c = server.client()
    beside: dict[str, object] = {}

    def long_request() -> None:
        beside["out"] = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=48, temperature=0,
                                             extra_body={"ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format"),
           ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
           ({"structured_outputs": {"grammar": 'root ::= "a" undefined_rule'}}, "structured_outputs.grammar"),
           ({"guided_regex": "a+", "guided_choice": ["b"]}, "guided_choice")]
    for body, field in bad:
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
        assert err.value.body["param"] == field and err.value.body["message"]
    t.join(60)
    assert beside["out"].usage.completion_tokens == 48
    assert server.wait_idle() == (0.0, 0, 0, 0)
