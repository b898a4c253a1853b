"""HTTP for sim's clients and servers: an in-process ASGI client (asgi_client.py), Hypercorn
on a loopback socket (loopback.py), a server-sent events parser (sse.py), and what a
hand-written ASGI app needs (raw_asgi.py)."""
