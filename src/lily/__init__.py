"""lily: fast inference for the Qwen3.5 / Qwen3.6 hybrid models."""

from lily._core import CheckpointError, ConfigError, LilyError, RequestError
from lily.chat import Chat
from lily.config import ModelConfig
from lily.generation import GenerationChunk, GenerationResult, GenerationStream
from lily.model import Model, Session
from lily.shortcuts import generate, load, stream_generate

__all__ = [
    "Chat",
    "CheckpointError",
    "ConfigError",
    "GenerationChunk",
    "GenerationResult",
    "GenerationStream",
    "LilyError",
    "Model",
    "ModelConfig",
    "RequestError",
    "Session",
    "generate",
    "load",
    "stream_generate",
]
__version__ = "0.1.0"
