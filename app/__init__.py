"""The application layer: one plain function per use case (app/exports.py: what an export carries and the one
export every route writes through), called by the CLI and the pipeline; it imports surgery, train, converters
and runtime."""
