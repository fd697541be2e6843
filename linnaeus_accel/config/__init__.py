"""Validated configuration: pydantic models over linnaeus' UPPERCASE YAML keys."""

from .loading import ConfigError, apply_opts, load_config, read_yaml, validate_config
from .root import Config, output_dir_problem

__all__ = [
    "Config",
    "ConfigError",
    "apply_opts",
    "load_config",
    "output_dir_problem",
    "read_yaml",
    "validate_config",
]
