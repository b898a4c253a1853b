"""Traces: the JSONL format (format.py), its schema checks (check.py), and what a replay must
reproduce (expect.py)."""
