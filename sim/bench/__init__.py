"""`sim bench` and the benchmarks beside peers: the online client (client.py, bench_command.py,
records.py, prefix.py), against `transformers serve` (online.py), GuideLLM (guidellm.py) and
llama.cpp (llamacpp.py: its builds in llamacpp_build.py, what it runs in llamacpp_runs.py,
its table in llamacpp_report.py), speculative decoding beside llama-server's
(speculative.py), and the capacity simulator's own speed (capacity_speed.py)."""
