"""The run configuration: a strict, documented schema loaded from YAML with command-line overrides.

    cfg = load_config("configs/grpo_toy.yaml", ["rollout.n=8", "trainer.total_steps=10"])

Every key is documented once, in `raygraph/config/schema.py` (`Field(description=...)`). Unknown
keys, wrong types, inconsistent settings and unknown registry names are all reported together in
one `ConfigError` before anything starts; unknown keys get a did-you-mean that searches the whole
schema (`actor.lr is not a field; did you mean actor.optim.lr?`). Nothing here imports Ray.
"""

from raygraph.config.checks import config_problems
from raygraph.config.loading import ConfigError, apply_overrides, build_config, load_config, to_yaml
from raygraph.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    CheckpointConfig,
    CriticConfig,
    DataConfig,
    JudgeConfig,
    KLInRewardConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    PoolConfig,
    RaygraphConfig,
    ReferenceConfig,
    RemoteRewardConfig,
    RewardConfig,
    RolloutConfig,
    ToyDataConfig,
    TrainerConfig,
    WarmStartConfig,
)

__all__ = [
    "RaygraphConfig", "ConfigError", "load_config", "build_config", "apply_overrides", "to_yaml",
    "config_problems", "ModelConfig", "DataConfig", "ToyDataConfig", "RolloutConfig", "OptimConfig",
    "ActorConfig", "CriticConfig", "ReferenceConfig", "RewardConfig", "RemoteRewardConfig", "JudgeConfig",
    "AlgorithmConfig", "KLInRewardConfig", "PlacementConfig", "PoolConfig", "TrainerConfig",
    "WarmStartConfig", "LoggingConfig", "CheckpointConfig",
]
