"""The processes' side: everything that starts, watches, stops and restarts the processes of a job
on this machine or in a SLURM allocation, below `meshfit launch` (meshfit.commands.launch_command,
the verb: its flags).

One job of N processes: local (run_job: started, watched, stopped together, an agreed save at a
caller's boundary), process (one launched process: its output, its last lines, it dies with the
launcher), output (which of their lines are shown), watchdog (what the launcher reads of them to
tell why a job must stop: status files, stopped processes, JAX's fatal lines). `--elastic`:
elastic (the loop of generations restarted on the survivors and grown back), losses (what ended
a generation, who was lost, how many survivors split the batch), growth (when growing back
pays), spares (processes started ahead, imports done, that take a new generation's places),
train_argv (the command each generation runs), mesh_history (the run's history of meshes
and mesh changes), slurm_step (an srun step as a generation).
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
