"""The processes' side: everything that starts, watches, stops and restarts the processes of a job
on this machine or in a SLURM allocation, below `meshfit launch` (meshfit.commands.launch_command).

One job of N processes (local: started, their output shown, stopped together, an agreed save at a
caller's boundary), what the launcher reads of them to tell why a job must stop (watchdog: status
files, JAX's fatal lines), and `--elastic`: generations restarted on the survivors and grown back
(elastic, the loop; generation: what ended one and who was lost, the next one's command and batch;
growth: when to grow back), the run's history of meshes (mesh_history), an srun step as a
generation (slurm_step), and the lines the launcher keeps out of the user's sight (output).
"""

from meshfit.parallel import engine as _engine


def __getattr__(name: str):  # a module of this package, imported when first named
    return _engine.submodule(__name__, name)
