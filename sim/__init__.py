"""sim: trace replay, synthetic loads and capacity planning on nanoserve's own engine.

sim imports nanoserve; nanoserve never imports sim. `cli.py` is the only module that imports
every command; each capability is a package (trace, load, replay, record, capacity, bench,
soak, http), and no two of them import each other in a cycle (pyproject.toml's contracts).
"""
