"""The coding-agent conversation the benches send: a system prompt, and a chunk of code repeated
to make a user message of the length a bench asks for."""

SYSTEM = (
    "You are a coding agent. You can read files, run tests and edit code. Think step by step, keep "
    "answers short, and call tools with JSON arguments. "
)
CHUNK = (
    "def handler(request):\n    data = parse(request.body)\n    if not data.valid:\n"
    "        raise BadRequest(data.errors)\n    return Response(render(data), status=200)\n"
)
