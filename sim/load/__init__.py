"""Workloads: the load spec language (spec.py), synthetic traces from it (synthetic.py),
the simulator's request lists (workload.py), and Azure's public traces (azure.py)."""
