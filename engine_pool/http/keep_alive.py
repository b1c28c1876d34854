"""How long the cluster's servers keep an idle connection, and how long its clients reuse one.

A client that reuses a pooled connection as long as the server keeps it (httpx's and uvicorn's
defaults are both 5 s) sometimes sends a request just as the server closes that connection. A call
that is not retried once sent — a spill, a slot save — then fails for nothing. So the node agent and
the engines keep an idle connection `SERVER_S`, and the clients in the cluster (the gateway's node
client, the node's client to its engines) let go of one after `CLIENT_S`, well before.
"""

from __future__ import annotations

import httpx

SERVER_S = 30.0
CLIENT_S = SERVER_S / 2

CLIENT_LIMITS = httpx.Limits(keepalive_expiry=CLIENT_S)
