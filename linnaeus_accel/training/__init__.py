"""The training loop: Trainer, the optimizer step, batches, the metric meter, validation passes,
GradNorm. It drives save and resume (checkpoints) and run_directory (outputs, lock, trackers).

Importing it keeps library notices that every run of a kind would print off the console
(``process.quiet``: Accelerate's "Removed shared tensor" at each save of a tied model)."""

from ..process.quiet import quiet_library_notices

quiet_library_notices()
