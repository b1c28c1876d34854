"""The wire formats both ends speak: the client APIs' translations, SSE framing, the node API.

The engine serves the OpenAI Responses and Anthropic Messages APIs by translating them onto its chat
path (`openai_responses`, `anthropic_messages`, writing `chat_types`' chat request and reading the
chat answer through `chat_result`, with `engine_options`, `bounds` and `field_names` for what they
pass on, refuse and rename); the gateway
imports the same translations and adds what needs state (stored responses, sessions). `sse` frames
both ends' streams; `report` and `volatile` are the reuse report and the prompt rules the gateway
and an engine exchange; `node` is the node agent's requests and results, used by the agent and by
its client; `slot_actions` the engine's slot-action answers its node agent reads; `engine_answers`
the engine's chat and completion answers as types; `codec` the one codec every request and result
dataclass here is written and read with; `metric_labels` keeps both ends' Prometheus labels alike.

Everything here is pure or framing only and imports nothing of the engine, the pool, the gateway or
storage (only the foundation: `engine_pool.errors`, `engine_pool.http`, `engine_pool.process`), so
each end can depend on it without pulling the other in (tests/test_layering.py holds it to that).
"""
