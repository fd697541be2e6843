"""Validation passes at boundaries: their loaders and how each pass runs the task's metrics."""
