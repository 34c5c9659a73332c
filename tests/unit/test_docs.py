"""The documentation: the site builds strict, the README stays short, the reference covers the code.

One strict MkDocs build into a temp dir (a few seconds) is shared by the tests that read the built pages. The CLI
and schema checks walk the typer app and the pydantic models here, independently of the generator
(``docs/_gen/reference.py``), and look for every command, option and field in the built HTML.
"""

from __future__ import annotations

import ast
import html
import inspect
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tests.helpers import ROOT

DOCS = ROOT / "docs"
MAX_LINE = 120  # issue 36: no page line over 120 characters outside tables and code blocks
MAX_README_LINES = 200
# The README's first lines, exactly as they were before the docs site (the two commands a newcomer types).
README_TOP = [
    "# hetrain",
    "",
    "    make demo    # sets up .venv, then trains under Prefect on emulated machines, preempts a spot node, recovers,"
    " finishes",
    "    make test    # sets up .venv, then runs the test suite",
]
# What a newcomer comes for, each one page away from the README (issue 36's "done when").
README_TASK_PAGES = ["docs/how-to/plan.md", "docs/how-to/train.md", "docs/how-to/data.md", "docs/how-to/resume.md",
                     "docs/how-to/recover.md", "docs/how-to/prefect-one-machine.md", "docs/how-to/prefect-cluster.md",
                     "docs/how-to/schedule.md", "docs/how-to/checkpoints.md", "docs/how-to/export.md",
                     "docs/how-to/troubleshooting.md", "docs/getting-started/install.md"]
# Each file format's page and the pydantic model at its top (the token and metrics files have none: see below).
SCHEMA_MODELS = {"cluster": "hetrain.spec.specs:ClusterSpec", "offers": "hetrain.spec.offers:OffersSpec",
                 "model": "hetrain.spec.specs:ModelSpec",
                 "plan": "hetrain.plan.schema:Plan", "profile": "hetrain.profiling.profile:Profile"}


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # the hook imports hetrain from this checkout
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"strict docs build failed:\n{done.stdout}\n{done.stderr}"
    return out


def page_text(site: Path, page: str) -> str:
    """A built page's HTML with tags dropped and entities decoded (what a reader sees, roughly)."""
    raw = (site / page / "index.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", " ", raw))


def section(site: Path, page: str, anchor: str, next_anchors: list[str]) -> str:
    """The built HTML of ``page`` from heading ``anchor`` to the first of ``next_anchors`` after it."""
    raw = (site / page / "index.html").read_text()
    start = raw.index(f'id="{anchor}"')
    ends = [raw.find(f'id="{a}"', start + 1) for a in next_anchors]
    end = min([e for e in ends if e > start] or [len(raw)])
    return html.unescape(re.sub(r"<[^>]+>", " ", raw[start:end]))


def test_a_broken_link_or_anchor_fails_the_strict_build(tmp_path):
    """mkdocs.yml's validation settings turn a missing page and a missing anchor into a failed build."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading) and [gone](missing.md)\n")
    (docs / "other.md").write_text("# Other\n")
    small = {k: config[k] for k in ("site_name", "strict", "validation", "markdown_extensions")}
    small.update(docs_dir=str(docs), nav=["index.md", "other.md"])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(small))
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "missing.md" in done.stderr and "no-such-heading" in done.stderr


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    assert lines[:4] == README_TOP


def test_readme_links_to_every_task_page_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    for task in README_TASK_PAGES:
        assert task in links, f"README.md does not link to {task}"
    for target in links:
        if "://" not in target:
            assert (ROOT / target).is_file(), f"README.md links to {target}, which does not exist"


def _prose_lines(text: str):
    """(number, line) of the lines outside fenced code, indented code blocks and tables."""
    fence = False
    prev_blank, in_list, indented_code = True, False, False
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fence = not fence
            continue
        indented = line.startswith("    ")
        indented_code = indented and not in_list and (prev_blank or indented_code)
        if stripped and not indented:
            in_list = bool(re.match(r"([-*]|\d+\.) ", stripped)) or (in_list and not prev_blank)
        prev_blank = not stripped
        if fence or indented_code or stripped.startswith("|"):
            continue
        yield n, line


def test_no_page_line_over_120_characters_outside_tables_and_code():
    sys.path.insert(0, str(DOCS / "_gen"))
    try:
        import reference
    finally:
        sys.path.remove(str(DOCS / "_gen"))
    pages = {str(p.relative_to(ROOT)): p.read_text() for p in DOCS.rglob("*.md")}
    pages.update({"README.md": (ROOT / "README.md").read_text(), "CHANGELOG.md": (ROOT / "CHANGELOG.md").read_text()})
    pages.update({f"docs/{path} (generated)": text for path, text in reference.pages().items()})
    long = [f"{name}:{n}: {len(line)} characters" for name, text in pages.items()
            for n, line in _prose_lines(text) if len(line) > MAX_LINE]
    assert not long, "\n".join(long)


def _cli_commands():
    import typer.main

    from hetrain.cli import app

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, path + [name])

    return list(walk(typer.main.get_command(app), ["hetrain"]))


def test_every_cli_command_and_option_is_in_the_reference(site):
    commands = _cli_commands()
    anchors = ["-".join(path) for path, _ in commands]
    assert len(commands) > 10  # the app really was walked
    for path, command in commands:
        text = section(site, "reference/cli", "-".join(path), [a for a in anchors if a != "-".join(path)])
        assert " ".join(path) in text
        for param in command.params:
            if getattr(param, "hidden", False) or param.name == "help":
                continue
            for flag in [*param.opts, *getattr(param, "secondary_opts", [])]:
                assert flag in text, f"{' '.join(path)}: {flag} is not in the CLI reference"


def _models_under(top: type[BaseModel]) -> list[type[BaseModel]]:
    found, todo = [], [top]
    while todo:
        model = todo.pop()
        if model in found:
            continue
        found.append(model)
        for field in model.model_fields.values():
            stack = [field.annotation]
            while stack:
                a = stack.pop()
                if inspect.isclass(a) and issubclass(a, BaseModel):
                    todo.append(a)
                stack.extend(typing.get_args(a))
    return found


@pytest.mark.parametrize("page", sorted(SCHEMA_MODELS))
def test_every_schema_field_is_in_the_reference(site, page):
    module, name = SCHEMA_MODELS[page].split(":")
    models = _models_under(getattr(__import__(module, fromlist=[name]), name))
    anchors = [m.__name__.lower() for m in models]
    for model in models:
        anchor = model.__name__.lower()
        text = section(site, f"reference/{page}", anchor, [a for a in anchors if a != anchor])
        for field_name, field in model.model_fields.items():
            key = field.alias or field_name
            assert key in text, f"{page}: {model.__name__}.{key} is not in the reference"


def test_token_file_keys_are_documented(tmp_path):
    """The token file has no pydantic model: write one and look for each of its keys in the page's table."""
    from hetrain.runtime.data import prepare_tokens

    (tmp_path / "corpus.txt").write_text("hello tokens\n" * 10)
    prepare_tokens(tmp_path / "corpus.txt", tmp_path / "corpus.bin")
    keys = json.loads((tmp_path / "corpus.bin.json").read_text())
    documented = (DOCS / "reference" / "tokens.md").read_text()
    for key in keys:
        assert f"| `{key}` |" in documented, f"token file key {key} is not in docs/reference/tokens.md"


def _metrics_keys() -> set[str]:
    """The keys the trainer writes into a metrics record: its dict literals and its ``record[...] =`` assignments."""
    tree = ast.parse((ROOT / "hetrain" / "runtime" / "trainer.py").read_text())
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "record" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                keys.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == "record"
                        and isinstance(t.slice, ast.Constant)):
                    keys.add(t.slice.value)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "ranks"
                and node.args and isinstance(node.args[0], ast.Dict)):
            keys.update(k.value for k in node.args[0].keys if isinstance(k, ast.Constant))
    return keys


def test_metrics_keys_are_documented():
    keys = _metrics_keys()
    assert {"step", "loss", "ranks", "compute_s", "backup_failed"} <= keys  # the walk finds what the trainer writes
    documented = (DOCS / "reference" / "metrics.md").read_text()
    # checkpoint_requested, stop_requested and live_requested are popped before the record is written
    popped = {"checkpoint_requested", "stop_requested", "live_requested"}
    missing = [k for k in sorted(keys - popped) if f"| `{k}` |" not in documented]
    assert not missing, f"metrics keys missing from docs/reference/metrics.md: {missing}"


def _documented_invocations():
    """(file, line number, command path, flags) of every ``hetrain <command> --flag ...`` the pages show.

    A line ending in a backslash continues on the next; a command's flags end at a comment, a backtick, a semicolon
    or the next command.
    """
    paths = sorted((p[1:] for p, _ in _cli_commands() if len(p) > 1), key=len, reverse=True)
    files = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    for f in files:
        lines = f.read_text().splitlines()
        joined, starts, buf, start = [], [], "", None
        for n, line in enumerate(lines, 1):
            start = start or n
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            joined.append(buf + line)
            starts.append(start)
            buf, start = "", None
        for n, line in zip(starts, joined):
            for m in re.finditer(r"(?<![\w./-])hetrain ((?:[a-z]+ ?)+)", line):
                words = m.group(1).split()
                path = next((p for p in paths if words[:len(p)] == p), None)
                if path is None:
                    continue
                rest = re.split(r"#|`|;|\bhetrain ", line[m.start() + len("hetrain "):])[0]
                yield f.relative_to(ROOT), n, path, re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)


def test_documented_commands_use_options_the_commands_have():
    """Every ``hetrain <command> --flag`` in the README and the docs is an option of that command (``--help``)."""
    options = {tuple(p[1:]): {"--help"} | {flag for param in c.params
                                           for flag in [*param.opts, *getattr(param, "secondary_opts", [])]}
               for p, c in _cli_commands()}
    found = list(_documented_invocations())
    assert len(found) > 30  # the pages really were read
    wrong = [f"{f}:{n}: hetrain {' '.join(path)} {flag}" for f, n, path, flags in found for flag in flags
             if flag not in options[tuple(path)]]
    assert not wrong, "options the commands do not have:\n" + "\n".join(wrong)
