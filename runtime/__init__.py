"""Reference PyTorch runtime for dense and BAM mixture models. Imports nothing from the other layers."""
from .config import ConfigError, ModelConfig, PRESETS, preset

__all__ = ["ConfigError", "ModelConfig", "PRESETS", "preset"]
