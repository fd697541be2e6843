"""Writing a run's state into checkpoints: the writer (staged by every process, committed in the
background by the main process, retained, uploaded), the host snapshot of ASYNC checkpoints, what
happens when a write fails, and the check that no NaN or infinite state is committed. The
checkpoint directory itself is ``checkpoint/directory/``."""
