"""sim: trace replay, synthetic loads and capacity planning on nanoserve's own engine.

sim imports nanoserve; nanoserve never imports sim. `commands.py` is the only module that
imports every command; each capability is a package, and no two of them import each other in a
cycle (pyproject.toml's contracts):

    trace/       the trace format: read, written, checked, journaled while recording
    load/        synthetic loads, the field's public traces, the simulator's workloads
    replay/      `sim replay`: a trace through nanoserve's own app, exactly
    target/      `sim replay --target`: the same clients and checks at any server
    record/      `serve --record`, and `sim record --upstream` (a recording proxy)
    capacity/    `sim capacity`, `profile`, `validate`: the engine on a cost model
    bench/       `sim bench` and the benchmarks beside the peers
    soak/        `sim soak`: many misbehaving clients against a live server
    http/        HTTP for sim's clients and servers

and beside them cli_util.py (what the commands share: the error guard, `--engine`),
stats.py (percentiles, durations, `--slo`) and files.py (every file written whole or not at
all). A fleet of real replicas is serving, not simulation: nanoserve/live_fleet.py.
"""
