"""sim: trace replay, synthetic loads and capacity planning on nanoserve's own engine.

sim imports nanoserve; nanoserve never imports sim.
"""
