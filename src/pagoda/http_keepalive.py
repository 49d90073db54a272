"""Keep-alive times of pagoda's HTTP servers and clients.

A server closes a connection that has been idle for its keep-alive time. A client that reuses a
pooled connection at the moment the server closes it gets "Server disconnected without sending a
response" or "Connection reset by peer" for a request the server never read. uvicorn's default
keep-alive and httpx's default pool expiry are both 5 s, so under many concurrent connections
that race happens. pagoda's servers (the OpenAI server, the router) keep connections for
SERVER_KEEP_ALIVE_S; its clients (the router's backend pool, `pagoda.lang`'s RuntimeEndpoint, the
benchmarks) drop pooled connections after CLIENT_KEEP_ALIVE_S, safely below it and below the 5 s
other engines (vLLM, SGLang) use.
"""

SERVER_KEEP_ALIVE_S = 5
CLIENT_KEEP_ALIVE_S = 2.0
