"""The process around a run: devices and shardings (mesh.py), processes and their peers
(processes.py, supervise.py), signals, phase timing, XLA's flags and compilation cache,
and the reports a run writes."""
