"""The memory plan: bytes per device of a model's train step, replicated ("data") and sharded
("fsdp"), from XLA's memory analysis of the compiled step; which mode fits; the largest batch;
for 'auto' with no model_parallel given, the model parallelism K when neither mode fits.
JAX engine only.

One module per job:
- lowering: the train step lowered and compiled (never run) on abstract arrays carrying each
  mode's shardings, and XLA's memory and cost analysis of it (`step_arguments`, `step_cost`);
- plan: one mode's plan (`ModePlan`, `plan_mode`) and a run's (`MemoryPlan`, frozen;
  `as_dict()` for `meshfit plan --json`);
- choice: both modes planned and what 'auto' picks (`plan_memory`, `auto_sharding`), and the
  model parallelism K where neither fits (`model_parallel_plans`);
- words: the plan's lines, the refusal of a mode that does not fit, the fsdp warning;
- abstract: models built with variables that have no value (`abstract_model`; the plan's
  private Keras imports);
- routes: the decision before a run builds its model (`choose_sharding`, given a `ModelBuilder`)
  and `meshfit.plan` (`plan_build`); first_fit: a plain `fit`'s (`plan_at_first_fit`).
"""

from meshfit.fit.memory_plan.abstract import abstract_model
from meshfit.fit.memory_plan.choice import (PlanOn, auto_sharding, model_parallel_candidates,
                                            model_parallel_plans, plan_memory, sharding_to_use,
                                            weighs_model_parallel)
from meshfit.fit.memory_plan.first_fit import first_fit_batch, plan_at_first_fit
from meshfit.fit.memory_plan.lowering import (axis_sizes, input_structs, state_groups, step_arguments,
                                              step_cost)
from meshfit.fit.memory_plan.plan import MemoryPlan, ModePlan, plan_mode
from meshfit.fit.memory_plan.routes import ModelBuilder, choose_sharding, plan_build
from meshfit.fit.memory_plan.words import check_fits, cost_text, replicated_warning, summary_lines

__all__ = ["MemoryPlan", "ModePlan", "ModelBuilder", "PlanOn", "abstract_model", "auto_sharding",
           "axis_sizes", "check_fits", "choose_sharding", "cost_text", "first_fit_batch",
           "input_structs", "model_parallel_candidates", "model_parallel_plans", "plan_at_first_fit",
           "plan_build", "plan_memory", "plan_mode", "replicated_warning", "sharding_to_use",
           "state_groups", "step_arguments", "step_cost", "summary_lines", "weighs_model_parallel"]
