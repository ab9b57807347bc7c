"""Typed configuration: schema (dataclasses), YAML loading with overrides, validation."""
from megarl.config.loader import (
    ConfigError, config_to_dict, config_to_yaml, load_config, save_config,
)
from megarl.config.schema import (
    CheckpointConfig, Config, DataConfig, LauncherConfig, LRScheduleConfig, ModelConfig, MoEConfig,
    OffloadConfig, OptimConfig, ParallelConfig, RewardModelConfig, RoleConfig, RolesConfig,
    SFTConfig, SyntheticConfig, TokenizerConfig,
    TrackingConfig, TrainConfig,
)
from megarl.config.validate import check_config, data_parallel_size, has_module, validate_config

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LRScheduleConfig", "LauncherConfig", "ModelConfig", "MoEConfig",
    "OffloadConfig", "OptimConfig", "ParallelConfig", "RewardModelConfig", "RoleConfig", "RolesConfig", "SFTConfig", "SyntheticConfig",
    "TokenizerConfig", "TrackingConfig", "TrainConfig", "check_config", "config_to_dict", "config_to_yaml",
    "data_parallel_size", "has_module", "load_config", "save_config", "validate_config",
]
