"""MkDocs hook: the CLI reference page built from meshfit.cli's argparse definitions (no flag
list is copied by hand), and the notebooks copied into the site for the tutorials page (a page's
link to the repository's notebooks/X.ipynb, right in the repository, leads to the site's copy)."""

from __future__ import annotations

import argparse
import glob
import html
import os
import re

PLACEHOLDER = "<!-- meshfit cli reference -->"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of `meshfit NAME`, with its arguments, as `meshfit NAME --help` uses it."""
    from meshfit import cli

    parser = cli._parser(name)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _text(value: str | None) -> str:
    return html.escape(" ".join((value or "").split())).replace("*", r"\*").replace("_", r"\_")


def markdown() -> str:
    """One section per command: its description, usage and every argument with its help."""
    from meshfit import cli

    lines = []
    for name in cli.COMMANDS:
        parser = command_parser(name)
        usage = " ".join(parser.format_usage().split())
        lines += [f"## meshfit {name}", "", _text(parser.description), "", "```", usage, "```", ""]
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            if action.option_strings:
                metavar = "" if action.nargs == 0 else " " + parser._get_formatter()._format_args(
                    action, action.dest.upper())
                names = ", ".join(f"`{option}{metavar}`" for option in action.option_strings)
            else:
                names = f"`{parser._get_formatter()._format_args(action, action.dest)}`"
            lines.append(f"- {names}: {_text(action.help)}")
        lines.append("")
    return "\n".join(lines)


def on_page_markdown(text: str, page, config, files) -> str:
    text = text.replace(PLACEHOLDER, markdown()) if PLACEHOLDER in text else text
    return notebook_links(text, page.file.src_uri, config["docs_dir"])


def notebook_links(text: str, src_uri: str, docs_dir: str) -> str:
    """Links of the page `src_uri` to ROOT/notebooks/X.ipynb (as the repository has them) pointed
    at the site's copies, docs_dir/notebooks/X.ipynb (see on_files)."""
    folder = os.path.dirname(os.path.join(docs_dir, src_uri))

    def site_link(match: re.Match) -> str:
        target = os.path.normpath(os.path.join(folder, match.group(2)))
        if os.path.dirname(target) != os.path.join(ROOT, "notebooks"):
            return match.group(0)
        copy = os.path.join(docs_dir, "notebooks", os.path.basename(target))
        return f"{match.group(1)}({os.path.relpath(copy, folder)})"

    return re.sub(r"(\[[^\]]*\])\(([^)\s#]+\.ipynb)\)", site_link, text)


def on_files(files, config):
    """Add notebooks/*.ipynb to the site as notebooks/NAME.ipynb (downloads)."""
    from mkdocs.structure.files import File

    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        files.append(File(os.path.join("notebooks", os.path.basename(path)), ROOT,
                          config["site_dir"], config["use_directory_urls"]))
    return files
