"""Typed run configuration: sections, TOML loading, overrides."""

from vatra.config._asyncdp import AsyncConfig, DiLoCoConfig, HybridConfig, LocalSGDConfig
from vatra.config._balance import BalanceConfig
from vatra.config._chaos import ChaosConfig
from vatra.config._comm import CommConfig
from vatra.config._edge import EdgeConfig
from vatra.config._energy import EnergyConfig
from vatra.config._federated import FederatedConfig, PartitionConfig
from vatra.config._live import ResilienceConfig
from vatra.config._load import (
    Config,
    apply_overrides,
    config_from_dict,
    dump_toml,
    load_config,
    parse_override,
)
from vatra.config._meta import MetaConfig
from vatra.config._monitor import HealConfig, MonitorConfig
from vatra.config._parallel import ParallelConfig
from vatra.config._privacy import PrivacyConfig, SecureAggregationConfig
from vatra.config._resilience import CheckpointConfig, ErasureConfig, StoreConfig
from vatra.config._sections import (
    DataConfig,
    DistConfig,
    DriftConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    Section,
    TrainConfig,
)
from vatra.config._spot import SpotConfig
from vatra.config._tune import ParamConfig, TuneConfig

__all__ = [
    "AsyncConfig",
    "BalanceConfig",
    "ChaosConfig",
    "CheckpointConfig",
    "CommConfig",
    "Config",
    "DataConfig",
    "DiLoCoConfig",
    "DistConfig",
    "DriftConfig",
    "EdgeConfig",
    "EnergyConfig",
    "ErasureConfig",
    "FederatedConfig",
    "HealConfig",
    "HybridConfig",
    "LocalSGDConfig",
    "MetaConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimConfig",
    "ParallelConfig",
    "ParamConfig",
    "PartitionConfig",
    "PrivacyConfig",
    "ResilienceConfig",
    "RunConfig",
    "Section",
    "SecureAggregationConfig",
    "SpotConfig",
    "StoreConfig",
    "TrainConfig",
    "TuneConfig",
    "apply_overrides",
    "config_from_dict",
    "dump_toml",
    "load_config",
    "parse_override",
]
