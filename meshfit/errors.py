"""The exceptions meshfit raises for user-facing problems: MeshfitError (the CLI prints it as one
line); TrainingInterrupted, the MeshfitError of a run stopped on a signal after saving; and
TrainingDiverged, of a run stopped because its weights became NaN or inf (here, without Keras: a
caller catches them around train(), imported before the engine is chosen).

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


class TrainingInterrupted(MeshfitError):
    """Training stopped on a signal after saving a checkpoint; `exit_code` is 128 + the signal."""

    def __init__(self, message: str, signum: int, checkpoint: str | None):
        super().__init__(message)
        self.signum = signum
        self.checkpoint = checkpoint
        self.exit_code = 128 + signum


class TrainingDiverged(MeshfitError):
    """Training stopped because the model's weights hold NaN or inf; nothing of them was saved,
    the run's committed checkpoints are as they were (meshfit.run.keras_side.divergence).
    `step`: the global step after which they did; `variable`: the first such variable's path."""

    def __init__(self, message: str, step: int, variable: str):
        super().__init__(message)
        self.step = step
        self.variable = variable
