"""The configuration: YAML decoded straight into frozen structs, then cross-checked.

Decoding rejects unknown fields and wrong types with a ``$.path``; it stops at the first such
error. Everything that needs more than one field to judge -- references between models and
providers, duplicates, enums, ranges -- is checked afterwards by :func:`validate`, which
reports *all* problems at once. The older route shape (``openai.model_routes`` +
``nodes[].adapters``) is still accepted: it is converted to the pool shape before validation.

    schema          the structs and their defaults
    validation      validate() and secrets_in_file()
    legacy          the legacy route shape and its conversion to the pool shape
    loading         load(path) and parse(data), the ways in
    decode_errors   msgspec's decoding errors as problems with a path
"""

from dispatcher.config.loading import Loaded, load, normalise_base_url, parse, read_document
from dispatcher.config.schema import (
    CATEGORIES,
    DEFAULT_CATEGORY,
    DEFAULT_TENANT,
    HTTP_TYPES,
    PROVIDER_TYPES,
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
    QueueConfig,
    RedisConfig,
    ResponsesConfig,
    SentinelConfig,
    TracingConfig,
    host_port,
)
from dispatcher.config.validation import secrets_in_file, validate

__all__ = [
    "CATEGORIES",
    "DEFAULT_CATEGORY",
    "DEFAULT_TENANT",
    "HTTP_TYPES",
    "PROVIDER_TYPES",
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
    "QueueConfig",
    "RedisConfig",
    "ResponsesConfig",
    "SentinelConfig",
    "TracingConfig",
    "host_port",
    "load",
    "normalise_base_url",
    "parse",
    "read_document",
    "secrets_in_file",
    "validate",
]
