"""Checkpoint surgery: recipe -> plan -> streamed execution, audits, and the CLI."""
__version__ = "0.1.0"
