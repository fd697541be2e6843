"""The run directory's life: its lock and claim, outputs and summary.json, console and trackers, run info,
shared-storage checks, preemption signals, failures (layer 5, below run_state and training)."""
