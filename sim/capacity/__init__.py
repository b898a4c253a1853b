"""Capacity planning: the step-cost model (cost.py) and its measurement (profile.py,
calibrate.py), the engine in modelled time (fleet.py: replicas; routers.py: the placement
policies, SGLang's cache_aware among them; plan.py: sweeps and SLO search; parallel.py: the
runs of a sweep on any concurrent.futures Executor), its metrics and reports (summary.py,
report.py), the check against the real engine or fleet (validate.py, measured.py),
speculative decoding at an acceptance rate (acceptance.py), and the commands `sim
capacity`, `sim profile` and `sim validate` (capacity_commands.py). The simulator's own speed
is measured with the other benchmarks (sim/bench/capacity_speed.py)."""
