"""Datasets: a registry by name and the built-in handwritten-digits dataset."""

from .registry import build_dataset, dataset_problems, get_dataset_builder, register_dataset

__all__ = ["build_dataset", "dataset_problems", "get_dataset_builder", "register_dataset"]
