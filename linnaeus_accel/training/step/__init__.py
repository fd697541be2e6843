"""One optimizer step: the windows of micro-batches, the step itself (LR from the plan, the loss over
every unit of the step, clipping) and GradNorm's loss weights."""
