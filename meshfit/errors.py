"""The one exception meshfit raises for user-facing problems; the CLI prints it as one line.

A problem with an entry in the troubleshooting page (docs/troubleshooting.md, "Troubleshooting" on
the site) names it: `MeshfitError(message, see="anchor")` ends the line with
"(see docs/troubleshooting.md#anchor)", and `troubleshooting("anchor")` gives that ending for a
warning.
tests/test_docs.py checks that every anchor named in the code exists on the page.
"""

TROUBLESHOOTING = "docs/troubleshooting.md"


def troubleshooting(anchor: str) -> str:
    """' (see docs/troubleshooting.md#anchor)': where the troubleshooting page explains a problem."""
    return f" (see {TROUBLESHOOTING}#{anchor})"


class MeshfitError(Exception):
    """A problem the user can fix; the message names it and the fix. see: the anchor of its
    entry in the troubleshooting page, appended to the message."""

    def __init__(self, message: str = "", see: str | None = None):
        super().__init__(message + (troubleshooting(see) if see else ""))
