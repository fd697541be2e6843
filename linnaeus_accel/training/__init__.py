"""The training loop: Trainer, the optimizer step, batches, the metric meter, validation passes,
GradNorm. It drives run_state (checkpoints, resume) and run_directory (outputs, lock, trackers).

Importing it keeps library notices that every run of a kind would print off the console
(``run_directory.quiet``: Accelerate's "Removed shared tensor" at each save of a tied model)."""

from ..run_directory.quiet import quiet_library_notices

quiet_library_notices()
