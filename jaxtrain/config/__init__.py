"""What a run is asked to do: every config key with its default (defaults.py), and the
checks that run once, where a run or a command starts (checks.py)."""
