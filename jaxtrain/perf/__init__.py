"""Speed and memory: the speedrun benchmark (benchmark.py), one step inspected (inspection.py,
hlo.py), profiler traces (profile.py) and XLA's memory analysis (memory.py)."""
