"""An option declared once, on the field of an options dataclass: its command-line flag, help sentence, allowed
values or bounds, and how the flag's text becomes the field's value. The CLI builds its click options from the
fields (cli/options.py:flag_option); the Python API takes the same fields as keywords. Plain data, no imports.

    @dataclass(frozen=True)
    class GGUFOptions:
        dtype: str | None = declared(None, "--dtype", "Type of the weight matrices ...", metavar="f32|f16|q8_0",
                                     parse=gguf_dtype)

Declared so: the merge's options (surgery/options.py:MergeOptions, whose fields add their recipe key and pipeline
types) and each export format's own (converters/base.py:Exporter.Options).
"""
from __future__ import annotations

from dataclasses import field
from typing import Any, Callable


def declared(default: Any, flag: str, help: str, *, metavar: str | None = None,
             choices: tuple[str, ...] | None = None, bounds: tuple[float | None, float | None] | None = None,
             min_open: bool = False, show_default: bool | str = False, parse: Callable[[Any], Any] | None = None,
             **more: Any) -> Any:
    """A dataclass field with its flag. show_default: a string is the flag's own default where it differs from the
    field's (--router-init random); parse: the flag's text -> the field's value (a flag with `parse` and no choices
    or bounds is read as text, so that `parse` words its own refusal); `more`: further metadata of the caller's."""
    return field(default=default, metadata=dict(flag=flag, help=help, metavar=metavar, choices=choices, bounds=bounds,
                                                min_open=min_open, show_default=show_default, parse=parse, **more))


def scalar_type(f: Any) -> str:
    """The first type of a declared field's annotation, as text (`int | None` -> "int"): the type its flag's text is
    read as (cli/options.py:flag_option; the Python API's options given as text, app/api.py)."""
    return str(f.type).split(" ")[0]


__all__ = ["declared", "scalar_type"]
