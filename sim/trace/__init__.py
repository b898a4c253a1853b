"""Traces: the JSONL format and its records (format.py), the strict loader (loader.py), its
schema checks (check.py), the writer (write.py), an unfinished recording's journal
(journal.py), and what a replay must reproduce (expect.py)."""
