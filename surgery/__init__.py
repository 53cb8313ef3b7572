"""Checkpoint surgery: recipe -> plan -> streamed execution, audits, and the CLI."""
