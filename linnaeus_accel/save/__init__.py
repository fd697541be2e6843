"""Writing a run's state into checkpoints: the writer (staged by every process, committed in the
background by the main process, retained, uploaded), the host snapshot of ASYNC checkpoints, and
what happens when a write fails. The checkpoint directory itself is ``checkpoint/``."""
