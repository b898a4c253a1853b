"""`sim bench` and the benchmarks beside peers: the online client (client.py, cli.py,
stats.py, prefix.py), against `transformers serve` (online.py), GuideLLM (guidellm.py) and
llama.cpp (llamacpp.py), and speculative decoding beside llama-server's (speculative.py)."""
