"""Workloads: the load spec language (spec.py), synthetic traces from it (synthetic.py),
the simulator's request lists (workload.py), Azure's public traces (azure.py), and the
field's other public traces: Mooncake, Alibaba, BurstGPT (public.py)."""
