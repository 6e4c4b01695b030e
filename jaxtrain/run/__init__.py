"""One training run from start to summary: the loop (loop.py) over a plan (plan.py), the
actions each chunk's results go to (actions.py), the run's callbacks assembled
(callbacks.py), its Session, resuming, and --mode=eval (evaluate_checkpoint.py)."""
