"""Capacity planning: the step-cost model (cost.py) and its measurement (profile.py,
calibrate.py), the engine in modelled time (fleet.py: replicas and routers; plan.py:
sweeps and SLO search), its metrics and reports (metrics.py, report.py), the check against
the real engine (validate.py), the simulator's own speed (bench.py), and `sim capacity`
(cli.py)."""
