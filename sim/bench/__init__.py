"""`sim bench` and the benchmarks beside peers: the online client (client.py, cli.py,
stats.py, prefix.py), against `transformers serve` (online.py), GuideLLM (guidellm.py) and
llama.cpp (llamacpp.py: its builds in llamacpp_build.py, what it runs in llamacpp_runs.py,
its table in llamacpp_report.py), and speculative decoding beside llama-server's
(speculative.py)."""
