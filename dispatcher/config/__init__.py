"""The configuration: YAML decoded into frozen structs, then cross-checked.

Every problem of a file is reported at once, each with its ``$.path``, in the order of the
file: the walk of :mod:`~dispatcher.config.field_rules` finds each unknown field, value of the
wrong type or out of range, and missing required field (where msgspec's decoding would stop
at the first), and lets a default stand in so that the rest is still decoded; then
:func:`validate` checks everything that needs more than one field to judge -- references
between models and providers, duplicates, enums, at least one model. The older route shape
(``openai.model_routes`` + ``nodes[].adapters``) is still accepted: it is converted to the
pool shape before validation.

    schema          the structs and their defaults
    field_rules     each field's type, range and reload policy, checked value by value
    validation      validate() and secrets_in_file()
    legacy          the legacy route shape and its conversion to the pool shape
    loading         load(path) and parse(data), the ways in
    decode_errors   msgspec's decoding errors as problems with a path
"""

from dispatcher.config.loading import Loaded, load, normalise_base_url, parse, read_document
from dispatcher.config.schema import (
    AUTO_LOAD_FLOOR,
    AUTO_MAX_CAPACITY,
    CATEGORIES,
    DEFAULT_CATEGORY,
    DEFAULT_TENANT,
    FIXED_LOAD_FLOOR,
    HTTP_TYPES,
    PROVIDER_TYPES,
    QUALIFY_TENANT,
    ApiConfig,
    Config,
    DemoConfig,
    DispatchConfig,
    FakeProviderConfig,
    KeyConfig,
    KeyLimits,
    ModelConfig,
    NodeConfig,
    ProviderConfig,
    QualifyConfig,
    QueueConfig,
    RedisConfig,
    ResponsesConfig,
    SentinelConfig,
    TracingConfig,
    config_digest,
    host_port,
)
from dispatcher.config.validation import secrets_in_file, validate

__all__ = [
    "AUTO_LOAD_FLOOR",
    "AUTO_MAX_CAPACITY",
    "CATEGORIES",
    "DEFAULT_CATEGORY",
    "DEFAULT_TENANT",
    "FIXED_LOAD_FLOOR",
    "HTTP_TYPES",
    "PROVIDER_TYPES",
    "QUALIFY_TENANT",
    "ApiConfig",
    "Config",
    "DemoConfig",
    "DispatchConfig",
    "FakeProviderConfig",
    "KeyConfig",
    "KeyLimits",
    "Loaded",
    "ModelConfig",
    "NodeConfig",
    "ProviderConfig",
    "QualifyConfig",
    "QueueConfig",
    "RedisConfig",
    "ResponsesConfig",
    "SentinelConfig",
    "TracingConfig",
    "config_digest",
    "host_port",
    "load",
    "normalise_base_url",
    "parse",
    "read_document",
    "secrets_in_file",
    "validate",
]
