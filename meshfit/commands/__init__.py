"""The command line's tools beyond training: bench (train-step and input timing), plan (the
memory plan of a recipe), runs (list and plot runs) and launch_command (`meshfit launch`'s flags;
the processes' side it runs is meshfit.launch); and ctrl_c, how a Ctrl-C ends any command.
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
