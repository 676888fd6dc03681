"""Job configuration: dataclasses, TOML + CLI loading, validation (torch-free)."""

from titan_k3.config.errors import ConfigError
from titan_k3.config.job_config import JobConfig
from titan_k3.config.manager import (
    config_to_dict,
    config_to_toml,
    help_text,
    load_job_config,
    split_overrides,
)

__all__ = ["ConfigError", "JobConfig", "config_to_dict", "config_to_toml", "help_text", "load_job_config", "split_overrides"]
