"""What every process (engine, node agent, gateway) is made of besides its routes: its settings flags
(and the limits gateway and engine share), logging, the event loop, signals, its metric families and
fatal start-up errors.

Nothing here imports the engine, the node agent, the protocol or the gateway, so any process can
depend on it without pulling the others in (tests/test_layering.py, "foundation")."""
