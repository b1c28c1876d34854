"""The code every process shares — errors, settings flags (and the limits gateway and engine share),
logging, credentials, HTTP bodies and deadlines, signals, CORS.

Engine, node agent and gateway each import these modules; nothing here imports the engine, the pool or
the gateway, so any process can depend on it without pulling the others in."""
