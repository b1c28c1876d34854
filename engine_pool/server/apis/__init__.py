"""The engine's endpoints for the OpenAI Responses, Anthropic Messages and Vertex AI APIs.

The translations themselves are protocol (`engine_pool.protocol.openai_responses`,
`.anthropic_messages`), shared with the gateway; here they are served statelessly, like llama-server
(`routes`), and Vertex AI's prediction envelope is unwrapped onto the chat path (`vertex`).
"""
