"""What every command shares: the consoles, ``user_errors``, the option bounds and small option parsers."""

from __future__ import annotations

import functools
import re

import typer
from rich.console import Console
from rich.text import Text

from hetrain.errors import HetrainError

# Option bounds, each far beyond any meaning: past them a typo hangs or exhausts memory instead of failing.
MAX_TIME_LIMIT_S = 24 * 3600.0  # one MILP solve
MAX_TIMEOUT_S = 3600.0  # a peer silent for an hour is gone
MAX_THREADS = 1024

# No markup in what the consoles print: messages carry paths and other programs' errors (gloo's
# "[/.../pair.cc:553]"), which rich would read as markup tags and fail on. Styles go in as Text.
out = Console(markup=False)
err = Console(stderr=True, markup=False)


def labelled(label: str, message: object, style: str = "bold red") -> Text:
    """``label: message`` with the label styled and the message exactly as it is."""
    return Text.assemble((f"{label}:", style), " ", str(message))


def one_line(message: object) -> str:
    """The message on one line: control characters (a newline in a key read from a file) shown escaped."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(message))


# The library names what it was given by field (`run_dir`, `restart`: RunRequest, TrainOptions); the CLI says the
# flag that sets it. Fields whose flag is not the field's name in dashes:
_FLAG_OF_FIELD = {"peers": "--peer", "checkpoints": "--no-checkpoints"}
_FIELD = re.compile(r"`([a-z][a-z0-9_]*)`")


def as_flags(message: object) -> str:
    """A library message with each named field (`` `run_dir` ``) as the flag that sets it (``--run-dir``)."""
    from hetrain.config import TrainOptions
    from hetrain.run.request import RunRequest

    fields = set(TrainOptions.model_fields) | set(RunRequest.model_fields)
    return _FIELD.sub(lambda m: _FLAG_OF_FIELD.get(m[1], "--" + m[1].replace("_", "-")) if m[1] in fields else m[0],
                      str(message))


def say_error(message: object) -> None:
    err.print(labelled("error", one_line(as_flags(message))), highlight=False, soft_wrap=True)


def say_note(message: object, console: Console | None = None) -> None:
    (console or err).print(labelled("note", as_flags(message), "yellow"), highlight=False, soft_wrap=True)


def user_errors(fn):
    """Turn HetrainError into one red line on stderr and exit code 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HetrainError as e:
            say_error(e)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def _int_list(text: str, option: str, most: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise HetrainError(f"{option}: expected comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1 or max(values) > most:
        raise HetrainError(f"{option}: expected integers from 1 to {most}, got '{text}'")
    return values


def _peer_urls(peers: list[str] | None) -> dict[str, str]:
    peer_urls = {}
    for item in peers or []:
        node, sep, url = item.partition("=")
        if not sep or not node or not url:
            raise HetrainError(f"--peer: expected NODE=URL, got '{item}'")
        peer_urls[node] = url
    return peer_urls
