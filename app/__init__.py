"""The application layer: one plain function per use case, with typed options (merge.py: the merge; params.py:
count-params and inspect; exports.py: what an export carries and the one export every route writes through).

The CLI (cli/) and the pipeline (pipeline/) call these functions; they import surgery, train, converters and
runtime, and print nothing themselves: warnings and progress go to the callbacks they are given.
"""
