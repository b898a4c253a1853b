"""What the tests share, a file each:

    drain.py            an engine run to the end
    http_harness.py     the in-process ASGI client over the stub app
    server_harness.py   the stub app and its settings
    stub_server.py      the stub behind a real Hypercorn, in a process of its own
    serve_process.py    `nanoserve serve` in a process of its own, on a free port
    toy_server.py       a small OpenAI-compatible server with faults to order (replay --target)
    fault_harness.py    the fault tests' helpers
    reference.py        the Hugging Face reference runs
    native_check.py     whether the native kernels must build here
    decode_stack.py     decode steps both ways: the one native call and the layer loop
    tenants.py          the prefix-heavy workload of the fleet tests
    tiny_llama.py       a tiny random Llama for tensor parallelism's processes
    tiny_checkpoints.py tiny checkpoints of each architecture, and their reference runs
    write_gguf.py       a checkpoint written as a GGUF, as llama.cpp's converter lays one out
    kquants.py          the tests' own Q4_K, Q5_K and Q6_K quantizers
"""
