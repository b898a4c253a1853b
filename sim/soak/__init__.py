"""`sim soak`: concurrent, flaky and slow clients against a live server (run.py, client.py,
plan.py), and what must hold afterwards (checks.py, twin.py)."""
