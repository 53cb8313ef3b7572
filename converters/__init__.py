"""Format adapters: Hugging Face architectures <-> canonical names, and exporters. May import runtime."""
from .inputs import open_checkpoint

__all__ = ["open_checkpoint"]
