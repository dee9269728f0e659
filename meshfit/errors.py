"""The one exception meshfit raises for user-facing problems; the CLI prints it as one line."""


class MeshfitError(Exception):
    """A problem the user can fix; the message names it and the fix."""
