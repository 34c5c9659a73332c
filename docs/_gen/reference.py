"""The generated reference pages: the CLI from the typer app, the file schemas from the pydantic models.

An MkDocs hook (``hooks:`` in ``mkdocs.yml``): ``on_files`` adds ``reference/cli.md`` and one page per
file schema to the build, written from the code at build time, so they cannot drift from it and
nothing generated is committed. The CLI page is what ``hetrain <command> --help`` prints (click's own
usage line and help records, typer's defaults and ranges included), walked from ``hetrain.cli.app``;
a schema page lists every field of the file's pydantic model and of each model nested in it (alias,
type, default, bounds, description). ``tests/unit/test_docs.py`` builds the site and checks that every
command, option and field appears.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

CLI_PAGE = "reference/cli.md"
PAGE_WIDTH = 118  # prose lines of every page stay within 120 characters (tests/unit/test_docs.py checks it)


def _prose(text: str) -> str:
    """A docstring or help text as markdown paragraphs wrapped to the page width (double backticks as code)."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(text).replace("``", "`"))
    return "\n\n".join(textwrap.fill(" ".join(p.split()), PAGE_WIDTH, break_long_words=False,
                                       break_on_hyphens=False) for p in paragraphs)


@dataclass(frozen=True)
class SchemaPage:
    """One file format: the page it gets, its ``schema`` id (if the file carries one) and its top model."""

    path: str
    title: str
    schema_id: str | None
    model: str  # "module:Class", imported when the page is built (keeps importing this hook cheap)
    intro: str


SCHEMA_PAGES = (
    SchemaPage("reference/cluster.md", "Cluster file", None, "hetrain.spec.specs:ClusterSpec",
               "A YAML file naming the cluster's nodes, their GPUs and links; `--cluster` of `plan`, `estimate`, "
               "`train`, `recover`, `switch`, `profile`. Read by `hetrain.spec.specs.load_cluster`. Built-in GPU "
               "types are in `hetrain/spec/catalog.py`; `gpu_types` adds your own ([GPU type](#gputype))."),
    SchemaPage("reference/offers.md", "Offers file", None, "hetrain.spec.offers:OffersSpec",
               "A YAML file listing the GPUs you could rent: per offer a node shape, a zone, how many nodes, "
               "prices on demand and on the spot market, the spot market's preemption rate and notice; zones "
               "joined by their bandwidth. `--offers` of `plan` ([Spot economics](../how-to/spot-economics.md)). "
               "Read by `hetrain.spec.offers.load_offers`. Examples are in `examples/offers/`."),
    SchemaPage("reference/model.md", "Model file", None, "hetrain.spec.specs:ModelSpec",
               "A YAML file describing a decoder-only transformer; `--model` of `plan`, `profile`, `train`. "
               "Read by `hetrain.spec.specs.load_model`. Examples are in `examples/models/`."),
    SchemaPage("reference/plan.md", "Plan file", "hetrain.plan/v1", "hetrain.plan.schema:Plan",
               "The JSON file `hetrain plan --out` writes and `estimate`, `train` read: the contract between "
               "planning and training. Read by `hetrain.plan.schema.load_plan`; written atomically. The "
               "embedded `model` is a [model file](model.md)'s content; `training` holds the "
               "[training settings](#trainingsettings) the plan was made for."),
    SchemaPage("reference/profile.md", "Profile file", "hetrain.profile/v1", "hetrain.profiling.profile:Profile",
               "The JSON file `hetrain profile --out` writes and `plan --profile` / `estimate --profile` read: "
               "measured per-block times and activation bytes per (GPU type, TP degree, micro-batch size), and "
               "the runtime's own costs. Read by `hetrain.profiling.profile.load_profile`."),
)


def _type_name(annotation) -> str:
    """A field's type as a reader writes it: ``list[int]``, ``str | None``, ``'bf16' | 'fp16'``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _nested_models(annotation) -> list[type[BaseModel]]:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _nested_models(a)]


_BOUND_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "min length", "max_length": "max length",
                "pattern": "pattern"}  # in the order a reader wants them: lower bound first


def _annotated_metadata(annotation) -> list:
    """Constraints inside the type (``NonNegativeFloat | None``: the ``>= 0`` rides on the union's member)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return list(annotation.__metadata__)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _annotated_metadata(a)]
    return []


def _bounds(field) -> str:
    """The constraints pydantic checks on a field (``>= 1``, ``<= 1024``, a pattern), from its metadata."""
    found = []
    metadata = list(field.metadata) + _annotated_metadata(field.annotation)
    for attr, word in _BOUND_WORDS.items():
        for meta in metadata:
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{word} `{value}`" if attr == "pattern" else f"{word} {value:g}"
                             if isinstance(value, float) else f"{word} {value}")
    return ", ".join(found)


def _default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return f"`{field.default_factory()!r}`"
    if field.default is PydanticUndefined:
        return ""
    return f"`{field.default!r}`"


def _cell(text: str) -> str:
    """Text fit for one cell of a markdown table: one line, pipes escaped."""
    return re.sub(r"\s+", " ", text).replace("|", "\\|").strip()


def field_name(name: str, field) -> str:
    """The key a file uses for a field: its alias where it has one (``schema`` for ``schema_``)."""
    return field.alias or name


def model_section(model: type[BaseModel]) -> str:
    """One model's fields as a table, under a heading its anchor (``#classname``) links to."""
    doc = inspect.cleandoc(model.__doc__ or "") if model.__doc__ and model.__doc__ != BaseModel.__doc__ else ""
    extra = model.model_config.get("extra")
    rows = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        rows.append(f"| `{field_name(name, field)}` | {_cell(_type_name(field.annotation))} | {_cell(_default(field))} "
                    f"| {_cell(_bounds(field))} | {_cell(field.description or '')} |")
    note = {"forbid": "Unknown keys are refused.", "allow": "Unknown keys are kept (tools may add their own)."}
    parts = [f"## {model.__name__}", f"`{model.__module__}.{model.__qualname__}`"]
    if doc:
        parts.append(_prose(doc))
    parts.append("\n".join(rows))
    if extra in note:
        parts.append(note[extra])
    return "\n\n".join(parts)


def models_under(top: type[BaseModel]) -> list[type[BaseModel]]:
    """The top model and every model its fields nest, each once, in the order a reader meets them."""
    order: list[type[BaseModel]] = []
    todo = [top]
    while todo:
        model = todo.pop(0)
        if model in order:
            continue
        order.append(model)
        for field in model.model_fields.values():
            todo.extend(_nested_models(field.annotation))
    return order


def import_model(path: str) -> type[BaseModel]:
    module, name = path.split(":")
    return getattr(__import__(module, fromlist=[name]), name)


def schema_markdown(page: SchemaPage) -> str:
    head = [f"# {page.title}", "*Generated from the code at build time by `docs/_gen/reference.py`.*",
            _prose(page.intro)]
    if page.schema_id:
        head.append(_prose(f'The file\'s first key is `"schema": "{page.schema_id}"`; a file of another schema or '
                           f"version is refused in one line (exit 2)."))
    return "\n\n".join(head + [model_section(m) for m in models_under(import_model(page.model))]) + "\n"


# --------------------------------------------------------------------------- the CLI


def cli_commands():
    """``(path, command, context)`` for every command and group of ``hetrain.cli.app``, in help order."""
    import typer.main

    from hetrain.cli import app

    root = typer.main.get_command(app)

    def walk(command, path, parent):
        ctx = command.context_class(command, info_name=path[-1], parent=parent)
        yield path, command, ctx
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, path + [name], ctx)

    yield from walk(root, ["hetrain"], None)


def cli_markdown() -> str:
    parts = ["# Command line", _prose("*Generated from `hetrain.cli.app` at build time by `docs/_gen/reference.py`: "
                                      "the usage lines and options are what `--help` prints.*"),
             "Exit codes of every command are in [Troubleshooting](../how-to/troubleshooting.md#exit-codes)."]
    for path, command, ctx in cli_commands():
        level = "#" * min(len(path) + 1, 4)
        parts.append(f"{level} {' '.join(path)}")
        if command.help:
            parts.append(_prose(command.help))
        parts.append(f"```text\n{command.get_usage(ctx)}\n```")
        subs = getattr(command, "commands", {})
        if subs:
            parts.append("\n".join(["| command | what it does |", "|---|---|"]
                                   + [f"| [`{' '.join(path + [n])}`](#{'-'.join(path + [n])}) "
                                      f"| {_cell(s.get_short_help_str(limit=200))} |" for n, s in subs.items()]))
        rows = [r for r in (p.get_help_record(ctx) for p in command.params) if r]
        args = [p for p in command.params if p.param_type_name == "argument"]
        if args:
            parts.append("Arguments: " + ", ".join(f"`{a.human_readable_name}`" for a in args))
        if rows:
            parts.append("\n".join(["| option | meaning |", "|---|---|"]
                                   + [f"| `{_cell(flags)}` | {_cell(text)} |" for flags, text in rows]))
    return "\n\n".join(parts) + "\n"


def pages() -> dict[str, str]:
    """Every generated page: its path under docs/ and its markdown."""
    out = {CLI_PAGE: cli_markdown()}
    out.update({p.path: schema_markdown(p) for p in SCHEMA_PAGES})
    return out


def on_files(files, config):
    """MkDocs hook: add the generated pages to the build (``File.generated``: they exist only in the site)."""
    from mkdocs.structure.files import File

    for path, content in pages().items():
        files.append(File.generated(config, path, content=content))
    return files
