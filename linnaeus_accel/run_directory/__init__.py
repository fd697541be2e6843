"""The run directory's life: its lock and claim, outputs and summary.json, the console and trackers,
run info, and the check that every machine sees it."""
