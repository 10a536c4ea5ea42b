"""lily: fast inference for the Qwen3.5 / Qwen3.6 hybrid models."""

from lily._core import CheckpointError, ConfigError, LilyError, RequestError

__all__ = ["CheckpointError", "ConfigError", "LilyError", "RequestError"]
__version__ = "0.1.0"
