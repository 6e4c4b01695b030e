"""One training run from start to summary: the loop (loop.py) over a plan (plan.py), its
start (start.py), rows (rows.py), the user's callbacks (callbacks.py), the --profile window
and the time-left line (profiling.py, projection.py), what its start made (session.py),
resuming, and the summary."""
