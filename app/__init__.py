"""The application layer: one plain function per use case (merge, count-params, ...), with typed options.

The CLI (cli/) and the pipeline (pipeline/) call these functions; they call the layers below (surgery, train,
converters, runtime) and print nothing themselves: warnings and progress go to the callbacks they are given.
"""
