"""meshfit: train any Keras model data-parallel on every core of a TPU, GPU or CPU.

`connect()` finds the devices and returns a `Strategy`; build the model in `strategy.scope()` and
fit as usual. A `Recipe` (a model, its data and hyperparameters) is what `meshfit train` trains.
Keras is imported only by `connect()` (after the engine is chosen), so import meshfit before keras
if you want meshfit to choose the Keras backend.
"""

from meshfit.errors import MeshfitError

__version__ = "0.1.0"
__all__ = ["connect", "Strategy", "EpochReport", "Recipe", "MeshfitError", "__version__"]


def __getattr__(name: str):
    if name in ("connect", "Strategy"):
        from meshfit.parallel import distribution

        return getattr(distribution, name)
    if name == "EpochReport":
        from meshfit.watch.report import EpochReport

        return EpochReport
    if name == "Recipe":
        from meshfit.recipes import Recipe

        return Recipe
    raise AttributeError(f"module 'meshfit' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names too (tab completion, `dir(meshfit)`), without importing them."""
    return sorted(set(globals()) | set(__all__))
