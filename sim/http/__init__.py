"""HTTP for sim's clients: an in-process ASGI client (asgi_client.py), Hypercorn on a
loopback socket (loopback.py), and a server-sent events parser (sse.py)."""
