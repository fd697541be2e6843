"""The training loop on Accelerate and the pieces it drives (transforms, loss, metrics)."""
