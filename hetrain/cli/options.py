"""Command-line options made from a pydantic model, so an option is declared once (its field).

``hetrain train`` takes ``hetrain.config.TrainOptions`` this way and the train flow takes the
same model as its parameter: the two cannot drift apart (tests/test_options.py compares them).
Each field becomes ``--field-name`` with the field's default, description and bounds; a bool
that defaults to true also gets ``--no-field-name``. The values are validated by the model,
and an invalid one is one line naming the option.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, get_args, get_type_hints

import typer
from annotated_types import Ge, Le
from pydantic import BaseModel, ValidationError

from hetrain.errors import HetrainError


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _bounds(metadata: list) -> dict[str, Any]:
    """typer's min/max from the field's ge/le (gt and the rest are left to the model's validation)."""
    bounds: dict[str, Any] = {}
    for m in metadata:
        if isinstance(m, Ge):
            bounds["min"] = m.ge
        elif isinstance(m, Le):
            bounds["max"] = m.le
    return bounds


def _parameter(name: str, info) -> inspect.Parameter:
    annotation = info.annotation
    flag = option_name(name)
    if annotation is bool and info.default is True:
        flag = f"{flag}/--no-{flag[2:]}"
    numeric = annotation in (int, float) or any(a in (int, float) for a in get_args(annotation))
    option = typer.Option(info.default, flag, help=info.description or "", show_default=info.default is not None,
                          **(_bounds(info.metadata) if numeric else {}))
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def model_options(model: type[BaseModel], into: str):
    """Decorate a typer command: ``model``'s fields become its options, passed as one ``into=model(...)``."""

    def decorate(fn):
        signature = inspect.signature(fn)
        hints = get_type_hints(fn, include_extras=True)  # the command's own options, resolved (typer.Option inside)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()
               if p.name != into]
        fields = list(model.model_fields)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            values = {name: kwargs.pop(name) for name in fields if name in kwargs}
            try:
                kwargs[into] = model(**values)
            except ValidationError as e:
                raise HetrainError(describe_option_error(e)) from None
            return fn(*args, **kwargs)

        params = own + [_parameter(name, info) for name, info in model.model_fields.items()]
        wrapper.__signature__ = signature.replace(parameters=params)  # inspect stops here, before __wrapped__
        return wrapper

    return decorate


def describe_option_error(e: ValidationError) -> str:
    """The first error as one line naming the option (``--lr: ...``), not the model's field."""
    first = e.errors()[0]
    loc = first["loc"]
    msg = first["msg"].removeprefix("Value error, ")
    where = option_name(str(loc[0])) if loc else "options"
    got = f", got {first['input']!r}" if loc and "input" in first else ""
    return f"{where}: {msg[0].lower() + msg[1:]}{got}"
