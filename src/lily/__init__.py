"""lily: fast inference for the Qwen3.5 / Qwen3.6 hybrid models."""

from lily._core import CheckpointError, ConfigError, LilyError, RequestError
from lily.config import ModelConfig
from lily.model import Model, Session

__all__ = ["CheckpointError", "ConfigError", "LilyError", "Model", "ModelConfig", "RequestError", "Session"]
__version__ = "0.1.0"
