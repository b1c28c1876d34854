"""HTTP as every process speaks it: request bodies read with complaints that name the field, another
service's answer read back, the internal credential, CORS, the header deadline and the middleware
base the edge layers share.

Errors come from `engine_pool.errors`; nothing here imports the engine, the node agent, the protocol
or the gateway (tests/test_layering.py, "foundation")."""
