"""The training metrics: the meter that keeps each step's loss on the device until a record reads it,
and the log that turns records into ``metrics.jsonl``, trackers and the console."""
