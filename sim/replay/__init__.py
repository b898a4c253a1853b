"""`sim replay`: a trace through the real app on the step (or virtual) clock (run.py, driver.py,
clock.py, clients.py, setup.py, replay_command.py), with the faults a trace can inject
(faults.py)."""
