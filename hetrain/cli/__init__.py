"""The ``hetrain`` command line (typer + rich).

The application layer: thin commands that validate their options, call the library and print.
One module per concern: ``plan`` (plan, estimate, profile), ``train``, ``checkpoints`` (serve,
export), ``recovery`` (recover, switch, restore, watch), ``simulate`` (a replayed spot market),
``node`` (node start), ``data`` (data prepare); ``common`` holds the consoles, ``user_errors`` and
the option bounds, ``options`` makes options from a pydantic model. The commands are registered
here, in the order the help lists them. Importing this package stays fast: torch and the planners
load inside the commands.
"""

from __future__ import annotations

import shutil

import typer

from hetrain.cli import checkpoints, data, node, plan, recovery, simulate, train
from hetrain.cli.common import err, say_error

# Help in a terminal narrower than this: click's two columns, which wrap the help text and keep every
# option's name whole; rich's panels (seven columns: names, switches, types, help...) need about this
# much before they cut names ("--global-batch-s…") to fit.
RICH_HELP_MIN_COLUMNS = 100
HELP_MARKUP = "rich" if shutil.get_terminal_size().columns >= RICH_HELP_MIN_COLUMNS else None

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=HELP_MARKUP,
                  help="Train large models on mixed, preemptible GPUs.")
for command in (plan.plan, plan.estimate, plan.profile, train.train, checkpoints.serve, recovery.recover,
                recovery.switch, checkpoints.export, recovery.restore, recovery.watch, simulate.simulate):
    app.command()(command)

node_app = typer.Typer(no_args_is_help=True, rich_markup_mode=HELP_MARKUP,
                       help="Run this machine as a node of a cluster.")
app.add_typer(node_app, name="node")
node_app.command("start")(node.node_start)

data_app = typer.Typer(no_args_is_help=True, rich_markup_mode=HELP_MARKUP, help="Prepare training data.")
app.add_typer(data_app, name="data")
data_app.command("prepare")(data.data_prepare)

__all__ = ["app", "data_app", "main", "node_app"]


def _cli_exceptions() -> tuple[type, ...]:
    """Click's exception base: typer >= 0.20 vendors click (``typer._click``), older typer uses click itself."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(__import__(module, fromlist=["ClickException"]).ClickException)
        except ImportError:
            pass
    return tuple(found)


def main() -> int:
    """The console script: typer's usage errors (a bad option value) as one line and exit code 2, like ours."""
    try:
        return app(standalone_mode=False) or 0
    except _cli_exceptions() as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `hetrain` or `hetrain data` alone: the help, on stdout
            print(e.ctx.get_help() if e.ctx is not None else e.format_message())
            return 0
        say_error(e.format_message())
        return e.exit_code
    except typer.Abort:
        err.print("aborted")
        return 130
