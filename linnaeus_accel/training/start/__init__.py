"""What is checked and built once before the first step: the Accelerator, the loaders, the optimizer
and its parameter groups, the backend (DDP, FSDP, DeepSpeed), the task against the first batch."""
