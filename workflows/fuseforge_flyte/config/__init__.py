"""platform.toml: the one config file of the platform, loaded into typed, frozen pydantic models.

schema.py holds the tables' models and PlatformConfig; loading.py where the config comes from (the resolved
config of a pod, FUSEFORGE_CONFIG, ./platform.toml, built-in defaults) and load_config/get_config;
overrides.py the FUSEFORGE__<SECTION>__<KEY> variables and `--set section.key=value`; messages.py turns
pydantic's ValidationError into a ConfigError naming the file (or variable) and the key path, e.g.
``platform.toml: [cluster].gpus must be an integer >= 0, got "two"``.
"""

from fuseforge_flyte.config.loading import (
    CONFIG_FILE_NAME,
    CONFIG_PATH_ENV,
    RESOLVED_CONFIG_ENV,
    config_from_dict,
    find_config_file,
    get_config,
    load_config,
)
from fuseforge_flyte.config.overrides import OVERRIDE_ENV_PREFIX, collect_overrides
from fuseforge_flyte.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    ConfigError,
    DataConfig,
    ElasticConfig,
    FlyteConfig,
    ImageConfig,
    PlatformConfig,
    Quantity,
    Toleration,
    TrackingConfig,
    TrainingDefaults,
)

__all__ = [
    "CONFIG_FILE_NAME", "CONFIG_PATH_ENV", "OVERRIDE_ENV_PREFIX", "RESOLVED_CONFIG_ENV", "CheckpointConfig",
    "ClusterConfig", "ConfigError", "DataConfig", "ElasticConfig", "FlyteConfig", "ImageConfig", "PlatformConfig",
    "Quantity", "Toleration", "TrackingConfig", "TrainingDefaults", "collect_overrides", "config_from_dict",
    "find_config_file", "get_config", "load_config",
]
