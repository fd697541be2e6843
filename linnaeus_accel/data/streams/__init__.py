"""Streams (``IterableDataset``): sharded across processes and DataLoader workers, their position
saved and resumed exactly, and read ahead."""
