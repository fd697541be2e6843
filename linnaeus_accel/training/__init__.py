"""The training loop: Trainer, the optimizer step, batches, the metric meter, validation passes,
GradNorm. It drives run_state (checkpoints, resume) and run_directory (outputs, lock, trackers)."""
