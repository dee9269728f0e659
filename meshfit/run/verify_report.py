"""`meshfit verify`'s judgement: each configuration's distance from the one-device reference,
step by step and variable by variable, as a multiple of the rounding floor; its verdict lines,
JSON and picture.

Distances are relative: a float variable's is ||w - w_ref|| / ||w_ref|| (integer variables,
random generators' counters, are not compared: what they drive, the numbers drawn, shows in the
weights and logs; micro-batches advance them per slice), a log's (loss, metric)
|v - v_ref| / |v_ref|; a step's is the largest over variables (weights) and over logs. The floor at each step is the same distance between the
reference and the reference trained again from weights moved by one rounding unit of the compute
dtype (meshfit.run.keras_side.verify_training.perturbed): how far rounding alone carries two
correct runs apart through these steps of this model.

Only finite training can be compared: a reference or floor run whose weights or logs hold NaN or
inf is a one-line error (check_finite), and a configuration's NaN distance counts as infinite,
so a configuration that alone turns NaN diverges (NaN compares false with every threshold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from meshfit.errors import MeshfitError

# A configuration diverges at the first step where its distance passes TOLERANCE x the floor
# (a floor below MIN_FLOOR counts as MIN_FLOOR, about one float32 rounding, so that a floor of
# ~0, as in a model whose weights barely move, cannot make rounding look like a bug).
# Measured on the 2-core test machine, loaded by parallel work, 2026-11-28 (tests/test_verify.py's
# models at 4 and 8 steps, and fashion-mnist-cnn at 8 steps of 1000, float32 and bfloat16): the
# correct configurations (2, 4 and 8 devices under data and fsdp, 2 and 4 micro-batches, 2 and 4
# steps per dispatch, a resume) stayed within 0.9-2.8 x the floor; the seeded defects started at
# 2.5e6 x or more in float32 and 8e2 x in bfloat16 (micro-batches' own dropout masks). 30 leaves a
# margin of 10 over the largest correct one and of 25 under the smallest defect. XLA on a CPU
# computes a program to the same bits whatever the load, so a busy machine does not move these.
TOLERANCE = 30.0
MIN_FLOOR = 1e-7
# A step whose floor reaches 1 / TOLERANCE in the weights and in the loss and metrics cannot be
# judged: there a configuration 100% off the reference, another model altogether, is within
# TOLERANCE x the floor. A model that amplifies rounding that much (MobileNetV2 from random weights
# under training=False, SGD 1e-2, 16 images a step: floors 2.0 and 0.23 by step 3, 2026-11-29)
# is judged on the steps before; fashion-mnist-cnn's floors in bfloat16, 4.2e-2 and 6.4e-4 after
# 4 steps, stay judged (its loss floor is tight).
BLIND_FLOOR = 1.0 / TOLERANCE
_TINY = 1e-30


@dataclass
class Verdict:
    """One configuration's verdict: `worst` (its largest multiple of the floor over all steps)
    and, when it diverges, the first such step and what moved most there."""

    name: str
    worst: float
    seconds: float
    steps: list[int]
    weight_distance: list[float]  # per step, relative (largest variable)
    log_distance: list[float]  # per step, relative (largest log)
    diverges_at: int | None = None
    times_floor: float = 0.0  # at that step
    variable: str | None = None  # the variable (or "metric NAME") that moved most there
    judged: int | None = None  # the last step judged, where the floor stops sooner (BLIND_FLOOR)

    @property
    def ok(self) -> bool:
        return self.diverges_at is None

    def line(self, steps: int) -> str:
        if self.judged is not None and self.steps[0] > self.judged:
            return f"  {self.name:42s} not judged: its first dispatch ends after step {self.judged}"
        if self.ok:
            through = f" through step {self.judged}" if self.judged is not None else ""
            return (f"  {self.name:42s} equal within rounding{through} ({_times(self.worst)} the "
                    "floor at most)")
        return (f"  {self.name:42s} diverges from step {self.diverges_at} of {steps}, "
                f"{_times(self.times_floor)} the floor, most in {self.variable}")


@dataclass
class Verdicts:
    """Every configuration's verdict, and how the floor was measured."""

    verdicts: list[Verdict]
    steps: int
    global_batch: int
    precision: str
    roundoff: float
    floor_steps: list[int]
    weight_floor: list[float]  # per step, relative
    log_floor: list[float]
    reference_seconds: float
    refusals: dict[str, str] = field(default_factory=dict)  # not run: name -> meshfit's reason
    judged: int | None = None  # the last step judged, where the floor stops sooner (BLIND_FLOOR)
    more: list[Verdicts] = field(default_factory=list)  # further precisions, each its own floor

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts) and all(m.ok for m in self.more)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def floor_line(self) -> str:
        return (f"rounding floor after {self.steps} steps: {self.weight_floor[-1]:.1e} (weights) and "
                f"{self.log_floor[-1]:.1e} (loss and metrics), relative; measured by training the "
                f"reference again from weights moved by one rounding unit of {self.precision} "
                f"(2^{round(math.log2(self.roundoff))} relative, random signs). A configuration "
                f"diverges where it passes {TOLERANCE:g} x the floor (a floor under "
                f"{MIN_FLOOR:g} counts as {MIN_FLOOR:g}; a metric that counts samples, such as "
                f"accuracy, has at least one sample's share).")

    def blind_line(self) -> str | None:
        """Why the steps after `judged` were not judged, or None when every step was."""
        if self.judged is None:
            return None
        blind = self.floor_steps.index(self.judged) + 1
        first = self.floor_steps[blind]
        left_out = f"step {first}" if first == self.steps else f"steps {first}-{self.steps}"
        return (f"{left_out} not judged: from step {first} rounding alone moves the weights by "
                f"{self.weight_floor[blind]:.1e} and the loss and metrics by "
                f"{self.log_floor[blind]:.1e} (relative), past 1/{TOLERANCE:g}: within "
                f"{TOLERANCE:g} x that, a configuration training another model altogether would "
                "pass; this model amplifies rounding that much (a lower learning rate, or "
                "normalized activations, amplify it less)")

    def lines(self) -> list[str]:
        head = (f"reference: 1 device, {self.steps} steps of {self.global_batch} samples, "
                f"{self.precision} ({self.reference_seconds:.1f} s)")
        body = [v.line(self.steps) for v in self.verdicts]
        body += [f"  {name:42s} {'' if reason.startswith('not comparable') else 'not run: '}{reason}"
                 for name, reason in self.refusals.items()]
        for other in self.more:  # its own reference and floor, then its verdict line(s)
            body.append(f"{other.precision}: its own reference on 1 device "
                        f"({other.reference_seconds:.1f} s) and floor {other.weight_floor[-1]:.1e} "
                        f"(weights), {other.log_floor[-1]:.1e} (loss and metrics), one rounding "
                        f"unit 2^{round(math.log2(other.roundoff))}")
            if other.judged is not None:
                body.append(f"{other.precision}: {other.blind_line()}")
            for v in other.verdicts:
                verdict = v.line(self.steps).strip()[len(v.name):].strip()
                body.append(f"  {v.name + ', ' + other.precision:42s} {verdict}")
        every = self.verdicts + [v for other in self.more for v in other.verdicts]
        bad = sum(not v.ok for v in every)
        tail = ("every configuration trains the reference's model" if not bad else
                f"{bad} of {len(every)} configuration(s) diverge: see docs/guides/verify.md")
        if self.judged is not None and not bad:
            tail += f" through step {self.judged} of {self.steps}"
        blind = [self.blind_line()] if self.judged is not None else []
        return [head, self.floor_line(), *blind, *body, tail]

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "steps": self.steps, "global_batch": self.global_batch,
                "precision": self.precision, "tolerance": TOLERANCE, "min_floor": MIN_FLOOR,
                "floor": {"how": "reference trained from weights moved by one rounding unit",
                          "roundoff": self.roundoff, "steps": self.floor_steps,
                          "weights": self.weight_floor, "logs": self.log_floor},
                "reference_seconds": self.reference_seconds, "judged_steps": self.judged or self.steps,
                "configurations": [
                    {"name": v.name, "ok": v.ok,
                     "verdict": v.line(self.steps).strip()[len(v.name):].strip(),
                     "diverges_at_step": v.diverges_at,
                     "times_floor": v.worst if v.ok else v.times_floor,
                     "variable": v.variable, "seconds": v.seconds, "steps": v.steps,
                     "weight_distance": v.weight_distance, "log_distance": v.log_distance}
                    for v in self.verdicts],
                "not_run": self.refusals,
                **({"precisions": [other.as_dict() for other in self.more]} if self.more else {})}


def _times(x: float) -> str:
    return "inf x" if math.isinf(x) else f"{x:.2g} x" if x < 100 else f"{x:.1e} x"


def _variable_distances(weights, reference) -> list[float]:
    import numpy as np  # start-up: this module is read by the command line before the data

    out = []
    for a, r in zip(weights, reference, strict=True):
        if not np.issubdtype(r.dtype, np.floating):
            out.append(0.0)  # a counter (see the module docstring)
            continue
        a64, r64 = a.astype(np.float64), r.astype(np.float64)
        out.append(_nan_as_inf(float(np.linalg.norm(a64 - r64) / max(np.linalg.norm(r64), _TINY))))
    return out


def _log_distances(logs: dict[str, float], reference: dict[str, float]) -> dict[str, float]:
    return {name: (_nan_as_inf(abs(logs[name] - value) / max(abs(value), _TINY))
                   if name in logs else math.inf)
            for name, value in reference.items()}


def _nan_as_inf(distance: float) -> float:
    return math.inf if math.isnan(distance) else distance


def first_non_finite(trace) -> int | None:
    """The first step after which a trace's weights or logs hold NaN or inf, else None."""
    import numpy as np  # start-up: see _variable_distances

    for step, logs, weights in zip(trace.steps, trace.logs, trace.weights):
        if not all(math.isfinite(v) for v in logs.values()) or not all(
                np.isfinite(w).all() for w in weights if np.issubdtype(w.dtype, np.floating)):
            return step
    return None


def check_finite(reference, floor, reference_name: str) -> None:
    """A MeshfitError where the reference or its floor twin is not finite: distances from NaN
    mean nothing, and every configuration would pass."""
    for trace, what in ((reference, f"the reference ({reference_name})"),
                        (floor, "the reference trained from weights moved by one rounding unit")):
        step = first_non_finite(trace)
        if step is None:
            continue
        fewer = f", or verify fewer steps (--steps {step - 1})" if step > 1 else ""
        raise MeshfitError(f"{what} holds NaN or inf after step {step}: verify compares training "
                           f"that stays finite; lower the learning rate or look for NaN or inf in the "
                           f"data{fewer}")


def _reference_at(reference, step: int, last: int) -> tuple[dict[str, float], list]:
    """The reference's logs averaged over steps last+1..step (fit's log of a dispatch of several
    steps is their mean), and its weights after `step`."""
    index = {s: i for i, s in enumerate(reference.steps)}
    chunk = [reference.logs[index[s]] for s in range(last + 1, step + 1)]
    logs = {name: sum(c[name] for c in chunk) / len(chunk) for name in chunk[0]}
    return logs, reference.weights[index[step]]


def judge(reference, floor, traces: dict, *, roundoff: float, precision: str,
          global_batch: int, refusals: dict[str, str] | None = None) -> Verdicts:
    """The verdict of each trace (name -> verify_training.Trace) against `reference`, in
    multiples of the floor (`floor`: the reference's perturbed twin); `refusals`: the
    configurations meshfit refused to run (name -> its reason), listed as not run."""
    weight_floor = [max(_variable_distances(w, r), default=0.0)
                    for w, r in zip(floor.weights, reference.weights)]
    log_floor = [max(_log_distances(a, r).values(), default=0.0)
                 for a, r in zip(floor.logs, reference.logs)]
    floor_at = dict(zip(reference.steps, zip(weight_floor, log_floor)))
    judged = _last_judged(reference.steps, weight_floor, log_floor)
    through = None if judged == reference.steps[-1] else judged
    counted = _counted_metrics(reference, global_batch)
    verdicts = []
    for name, trace in traces.items():
        verdict = Verdict(name, 0.0, trace.seconds, list(trace.steps), [], [], judged=through)
        last = 0
        for step, logs, weights in zip(trace.steps, trace.logs, trace.weights):
            ref_logs, ref_weights = _reference_at(reference, step, last)
            last = step
            variables = _variable_distances(weights, ref_weights)
            log_distances = _log_distances(logs, ref_logs)
            w, l = max(variables, default=0.0), max(log_distances.values(), default=0.0)
            verdict.weight_distance.append(w)
            verdict.log_distance.append(l)
            if step > judged:
                continue  # drawn, not judged
            fw, fl = floor_at[step]
            times_w = w / max(fw, MIN_FLOOR)
            times_l = max((d / max(fl, counted.get(name, 0.0) / max(abs(ref_logs[name]), _TINY),
                                   MIN_FLOOR) for name, d in log_distances.items()), default=0.0)
            times = max(times_w, times_l)
            verdict.worst = max(verdict.worst, times)
            if verdict.diverges_at is None and times > TOLERANCE:
                verdict.diverges_at, verdict.times_floor = step, times
                if times_w > TOLERANCE:
                    j = max(range(len(variables)), key=variables.__getitem__)
                    verdict.variable = _variable_words(trace.paths[j])
                else:
                    verdict.variable = "metric " + max(log_distances, key=log_distances.get)
        verdicts.append(verdict)
    return Verdicts(verdicts, reference.steps[-1], global_batch, precision, roundoff,
                    list(reference.steps), weight_floor, log_floor, reference.seconds,
                    refusals=dict(refusals or {}), judged=through)


def _last_judged(steps: list[int], weight_floor: list[float], log_floor: list[float]) -> int:
    """The last step before the first whose floors both reach BLIND_FLOOR (all steps: the last);
    a MeshfitError where that is the first step (nothing could be judged)."""
    for i, (step, fw, fl) in enumerate(zip(steps, weight_floor, log_floor)):
        if fw >= BLIND_FLOOR and fl >= BLIND_FLOOR:
            if i == 0:
                raise MeshfitError(
                    f"verify cannot judge this model: after step {step} rounding alone moves its "
                    f"weights by {fw:.1e} and its loss and metrics by {fl:.1e} (relative), so any "
                    f"configuration, another model altogether, would be within {TOLERANCE:g} x that; "
                    "lower the learning rate or normalize the activations (BatchNormalization in "
                    "training, LayerNormalization) so that rounding moves it less")
            return steps[i - 1]
    return steps[-1]


def _counted_metrics(reference, global_batch: int) -> dict[str, float]:
    """The metrics that count samples (accuracy: correct ones of the batch), each with its
    resolution, one sample's share (1 / global_batch). One sample whose top two outputs lie within
    a rounding of each other takes either class in two correct runs: in bfloat16 fashion-mnist-cnn
    on 8 devices moved its accuracy by 1 of 1000 at step 1 (5.6e-3 relative) where the floor run
    had moved it by none, 770 x a floor of 7e-6, while the weights stayed within 1.1 x theirs
    (2026-11-28). Such a metric's floor is at least that resolution; a metric summed instead of
    averaged moves by whole multiples of it and still shows."""
    names = set(reference.logs[0]) - {"loss"} if reference.logs else set()
    return {name: 1.0 / global_batch for name in names
            if all(abs(logs[name] * global_batch - round(logs[name] * global_batch)) < 1e-3
                   for logs in reference.logs)}


def _variable_words(path: str) -> str:
    """'sequential/dense_1/kernel' -> 'variable kernel of layer sequential/dense_1'."""
    layer, _, variable = path.rpartition("/")
    return f"variable {variable} of layer {layer}" if layer else f"variable {variable}"


def plot(verdicts: Verdicts, reference, traces: dict, path: str) -> None:
    """Loss per step (the reference and every configuration, overlaid) and each configuration's
    weight distance per step on a log scale, with the floor and the threshold."""
    import matplotlib  # start-up: only when a picture is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, distances) = plt.subplots(1, 2, figsize=(12, 4.5))
    losses.plot(reference.steps, [logs.get("loss", math.nan) for logs in reference.logs], "k-",
                linewidth=3, alpha=0.4, label="1 device (reference)")
    for verdict in verdicts.verdicts:
        trace = traces[verdict.name]
        losses.plot(trace.steps, [logs.get("loss", math.nan) for logs in trace.logs], ".--",
                    label=verdict.name)
        distances.plot(verdict.steps, [max(d, 1e-17) for d in verdict.weight_distance], ".-",
                       label=f"{verdict.name}: {'ok' if verdict.ok else 'DIVERGES'}")
    floor = [max(f, MIN_FLOOR) for f in verdicts.weight_floor]
    distances.plot(verdicts.floor_steps, floor, "k:", label="rounding floor")
    distances.plot(verdicts.floor_steps, [TOLERANCE * f for f in floor], "r:",
                   label=f"threshold ({TOLERANCE:g} x floor)")
    if verdicts.judged is not None:
        distances.axvline(verdicts.judged + 0.5, color="grey", linestyle="--",
                          label=f"judged through step {verdicts.judged}")
    distances.set_yscale("log")
    losses.set(xlabel="step", ylabel="loss", title="loss per step")
    distances.set(xlabel="step", ylabel="weight distance from the reference (relative)",
                  title="distance per step")
    losses.legend(fontsize=7)
    distances.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
