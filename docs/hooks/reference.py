"""MkDocs hook: the pages generated from the code and the results at build time.

`accuracy.md` is `benchmarks/accuracy_page.py`'s page of `benchmarks/results/`, made by
the same function the script runs, so the site never shows a stale copy.

`docs/reference/cli.md` holds the marker ``<!-- cli-reference -->``; it is replaced by
each command of the typer app (`typer.main.get_command`), its usage, arguments and options,
read from the click objects typer builds, so the page follows the CLI as declared.
`docs/reference/api.md` holds ``<!-- api-reference -->``; it is replaced by one mkdocstrings
directive per name of `batchfit.__all__`, so the page follows the public API.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

CLI_MARKER = "<!-- cli-reference -->"
API_MARKER = "<!-- api-reference -->"
_RICH_TAG = re.compile(r"\[/?(?:bold|italic|dim|red|green|yellow|cyan|magenta|blue|b|i|code)\]")


def _plain(text: str | None) -> str:
    """Help text without rich markup, on one line, with Markdown's table pipes escaped."""
    text = _RICH_TAG.sub("", text or "")
    return " ".join(text.split()).replace("|", "\\|")


def _param_rows(command) -> list[str]:
    import click

    rows = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        if isinstance(param, click.Argument):
            name = f"`{param.human_readable_name}`"
            default = ""
        else:
            name = ", ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])
            default = param.default
            show = param.show_default
            default = "" if default in (None, False, (), []) or show is False else f"`{default}`"
        rows.append(f"| {name} | {_plain(getattr(param, 'help', ''))} | {default} |")
    return rows


def cli_reference_markdown() -> str:
    """The Markdown of every command of `batchfit` (`batchfit.cli.app.app`)."""
    import click
    import typer.main

    from batchfit.cli.app import app

    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="batchfit")
    parts = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if command is None or command.hidden:
            continue
        sub = click.Context(command, info_name=name, parent=ctx)
        usage = " ".join(command.collect_usage_pieces(sub))
        parts.append(f"## `batchfit {name}`\n")
        parts.append(_plain(command.help or command.short_help) + "\n")
        parts.append(f"```\nbatchfit {name} {usage}\n```\n")
        rows = _param_rows(command)
        if rows:
            parts.append("| argument or option | meaning | default |\n|---|---|---|")
            parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def api_reference_markdown() -> str:
    """One mkdocstrings directive per public name of `batchfit`, from its module."""
    import batchfit

    parts = []
    for name in batchfit.__all__:
        obj = getattr(batchfit, name)
        module = batchfit._LAZY.get(name) or getattr(obj, "__module__", "batchfit")
        parts.append(f"::: {module}.{name}\n")
    return "\n".join(parts)


def accuracy_page_markdown() -> str:
    """`benchmarks/accuracy_page.py`'s page (a script, not a module of the package)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy_page.py"
    spec = importlib.util.spec_from_file_location("accuracy_page", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.page()


def on_files(files, config):
    from mkdocs.structure.files import File

    if files.get_file_from_path("accuracy.md") is None:
        files.append(File.generated(config, "accuracy.md", content=accuracy_page_markdown()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference_markdown())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference_markdown())
    return markdown
