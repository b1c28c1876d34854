"""Chat templates the engine knows by name, for `--chat-template NAME` (llama-server's built-ins).

llama-server accepts a built-in template name (the names of llama.cpp's `llama-chat.cpp`) and falls
back to ChatML when a model has no template of its own. These are our own jinja templates that
render those formats — not copies of upstream text — for the names in common use:

- `chatml`: `<|im_start|>{role}\n{content}<|im_end|>\n`, generation prompt `<|im_start|>assistant\n`;
  tools Hermes/Qwen style (`<tools>` in the system turn, `<tool_call>{json}</tool_call>`, tool
  results as `<tool_response>` in a user turn).
- `gemma`: `<start_of_turn>{user or model}\n{content}<end_of_turn>\n` after the BOS text; system
  text opens the next user turn.
- `llama3`: `<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>` after the BOS text.
- `mistral-v7`: `[SYSTEM_PROMPT] ..[/SYSTEM_PROMPT]`, `[INST] ..[/INST]`, ` {answer}</s>`.
- `command-r`: `<|START_OF_TURN_TOKEN|><|{SYSTEM,USER,CHATBOT}_TOKEN|>{trimmed content}<|END_OF_TURN_TOKEN|>`,
  generation prompt `<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>` (Cohere's format).

Only `chatml` carries a tool-call format (the one `tool_calls.py` parses); the others refuse a
request with tools (400) rather than silently drop them. Content may be a string or a list of text
parts; `none` content (an assistant turn with only tool calls) renders as empty.
"""

from __future__ import annotations

# Every template starts with this macro: content as a string, a list of text parts, or none.
_TEXT = r"""{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""


def _no_tools(name: str) -> str:
    return (
        "{%- if tools -%}{{- raise_exception(\"the built-in '" + name + "' chat template has no "
        'tool-call format; use --chat-template chatml or a template made for tools") -}}{%- endif -%}\n'
    )


def _builtin(name: str, body: str, reply_opening: str = "", *, tools: bool = False) -> str:
    """The template `name`: the `text` macro; unless it has a tool-call format (`tools`), the
    refusal of a request with tools; `body`, which renders the conversation; and, when the request
    asks for the generation prompt, `reply_opening` (jinja string text: `\\n` is a newline)."""
    prompt = "{%- if add_generation_prompt -%}\n    {{- '" + reply_opening + "' -}}\n{%- endif -%}\n"
    return _TEXT + ("" if tools else _no_tools(name)) + body + (prompt if reply_opening else "")


# Each format's turns: the conversation, which `_builtin` makes a whole template.
_CHATML_TURNS = r"""{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages and messages[0].role == 'system' -%}
        {{- text(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' -}}{{- tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments' -}}
    {{- ' within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if tools and loop.first and message.role == 'system' -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text(message.content) -%}
        {{- '<|im_start|>assistant' -}}
        {%- if content or not message.tool_calls -%}
            {{- '\n' + content -}}
        {%- endif -%}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {{- '\n<tool_call>\n{"name": ' -}}{{- fn.name | tojson -}}{{- ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>user\n<tool_response>\n' + text(message.content) -}}
        {{- '\n</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
"""

_GEMMA_TURNS = r"""{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- if message.role in ('system', 'developer') -%}
        {%- set ns.system = ns.system + (text(message.content) | trim) -%}
    {%- else -%}
        {%- set role = 'model' if message.role == 'assistant' else message.role -%}
        {{- '<start_of_turn>' + role + '\n' -}}
        {%- if ns.system and role != 'model' -%}
            {{- ns.system + '\n\n' -}}
            {%- set ns.system = '' -%}
        {%- endif -%}
        {{- (text(message.content) | trim) + '<end_of_turn>\n' -}}
    {%- endif -%}
{%- endfor -%}
"""

_LLAMA3_TURNS = r"""{{- bos_token -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' -}}
    {{- (text(message.content) | trim) + '<|eot_id|>' -}}
{%- endfor -%}
"""

_MISTRAL_V7_TURNS = r"""{{- bos_token -}}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {{- '[SYSTEM_PROMPT] ' + text(message.content) + '[/SYSTEM_PROMPT]' -}}
    {%- elif message.role == 'user' -%}
        {{- '[INST] ' + text(message.content) + '[/INST]' -}}
    {%- elif message.role == 'assistant' -%}
        {{- ' ' + text(message.content) + eos_token -}}
    {%- else -%}
        {{- raise_exception("the built-in 'mistral-v7' chat template has no role " + message.role) -}}
    {%- endif -%}
{%- endfor -%}
"""

_COMMAND_R_TURNS = r"""{%- set tags = {'system': 'SYSTEM', 'developer': 'SYSTEM',
                     'user': 'USER', 'assistant': 'CHATBOT'} -%}
{%- for message in messages -%}
    {%- if message.role in tags -%}
        {{- '<|START_OF_TURN_TOKEN|><|' + tags[message.role] + '_TOKEN|>' -}}
        {{- (text(message.content) | trim) + '<|END_OF_TURN_TOKEN|>' -}}
    {%- else -%}
        {{- raise_exception("the built-in 'command-r' chat template has no role " + message.role) -}}
    {%- endif -%}
{%- endfor -%}
"""

CHATML = _builtin("chatml", _CHATML_TURNS, r"<|im_start|>assistant\n", tools=True)
GEMMA = _builtin("gemma", _GEMMA_TURNS, r"<start_of_turn>model\n")
LLAMA3 = _builtin("llama3", _LLAMA3_TURNS, r"<|start_header_id|>assistant<|end_header_id|>\n\n")
MISTRAL_V7 = _builtin("mistral-v7", _MISTRAL_V7_TURNS)
COMMAND_R = _builtin("command-r", _COMMAND_R_TURNS, "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")

# name -> jinja source; `--chat-template NAME` looks names up here.
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "gemma": GEMMA,
    "llama3": LLAMA3,
    "mistral-v7": MISTRAL_V7,
    "command-r": COMMAND_R,
}

# The text that ends an assistant turn in each format. A model whose vocabulary lacks it as a special
# token (Gemma 3 under the ChatML fallback) writes it as text: chat generations stop on it.
END_OF_TURN: dict[str, str] = {
    CHATML: "<|im_end|>",
    GEMMA: "<end_of_turn>",
    LLAMA3: "<|eot_id|>",
    MISTRAL_V7: "</s>",
    COMMAND_R: "<|END_OF_TURN_TOKEN|>",
}
