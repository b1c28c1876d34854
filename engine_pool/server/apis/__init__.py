"""The OpenAI Responses API and the Anthropic Messages API as translations onto the chat path.

`responses` and `messages` are pure (no I/O): a request in the API's shape becomes a chat
completions body, and the chat completion — or its chunk stream — becomes the API's response or
named events. The engine serves them (`routes`, stateless like llama-server); the gateway imports
the same translations and adds what needs state (stored responses, sessions).
"""
