"""`meshfit bench --scaling`: the same model and global batch on 1, 2, 4 and 8 devices.

Strong scaling: the global batch stays the same and is split over more devices, so a perfect
machine trains n times the samples per second on n devices. For each count the meshfit path of
`meshfit bench` (meshfit.commands.bench.step) runs in a fresh worker process: on accelerators on
the first n devices of the machine (counts above the machine's are skipped); on a CPU on n
simulated devices sharing its cores, which shows meshfit's overhead of more devices rather than
any speed-up. Reported per count: samples/s, the efficiency against linear (samples/s / (n x
samples/s on 1 device)), MFU, and where the fit's time went (the goodput parts of
meshfit.watch.goodput: compile, train, input wait, eval, other). Writes scaling.json and
scaling.png (samples/s against linear, and the parts as stacked bars) to --out.
"""

from __future__ import annotations

import os
import time
from typing import Any

from meshfit import recipes
from meshfit.commands.bench import step, worker
from meshfit.errors import MeshfitError
from meshfit.parallel import modes
from meshfit.run import rundir
from meshfit.watch import figures, goodput

DEFAULT_COUNTS = (1, 2, 4, 8)


def bench_scaling(recipe: str = recipes.DEFAULT, counts: list[int] | None = None, *,
                  global_batch: int | None = None, precision: str | None = None,
                  repeats: int = step.DEFAULT_REPEATS, steps: int | None = None,
                  out: str | None = None) -> dict[str, Any]:
    """Measure the recipe's train step on each device count (see the module docstring); write
    scaling.json and scaling.png; return the result. global_batch: samples per step over all
    devices (default 16 per device of the largest count); steps: timed steps per repeat."""
    steps = step.DEFAULT_STEPS if steps is None else steps
    the_recipe = recipes.load(recipe)
    counts = sorted(set(counts or DEFAULT_COUNTS))
    if counts[0] < 1:
        raise MeshfitError(f"--scaling counts must be at least 1, got {counts[0]}")
    step.check_counts(None, [precision] if precision else None, repeats, steps, 1, None)
    spec = {"recipe": the_recipe.file or the_recipe.name, "engine": "jax", "path": "meshfit",
            "precisions": [precision] if precision else None,
            "global_batches": [global_batch or _batch_for(counts)], "steps_per_dispatch": [1],
            "repeats": repeats, "steps": steps, "sharding": modes.DATA.name, "fsdp_min_bytes": None,
            "device_memory": None}
    rows, machine, skipped = [], None, []
    for count in counts:
        simulated = machine is not None and machine["platform"] == "cpu" and count > 1
        if machine is not None and not simulated and count > machine["devices"]:
            skipped.append(f"{count} devices: this machine has {machine['devices']}")
            continue
        found, meta, error = worker.run(step.WORKER, {
            **spec, "scaling_devices": count, "simulate_devices": count if simulated else None})
        if error:
            raise MeshfitError(f"--scaling on {count} device(s): {error}")
        machine = machine or meta
        for row in found:
            row.update(devices=count, simulated=simulated)
        rows += found
    add_efficiency(rows)
    out = out or rundir.timestamped("scaling")
    result = {"recipe": the_recipe.name, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": worker.command_line(), "machine": machine, "skipped": skipped,
              "out": out, "rows": rows}
    os.makedirs(out, exist_ok=True)
    step.table.write_json(result, out)
    os.replace(os.path.join(out, "bench.json"), os.path.join(out, "scaling.json"))
    plot(result, os.path.join(out, "scaling.png"))
    return result


def _batch_for(counts: list[int]) -> int:
    """A global batch every count splits evenly: 16 samples a device on the largest count."""
    largest = max(counts)
    return 16 * largest


def add_efficiency(rows: list[dict[str, Any]]) -> None:
    """Fill `efficiency` in place: samples/s / (devices x the 1-device row's samples/s)."""
    base = next((r["samples_per_s"] / r["devices"] for r in rows if r["devices"] == 1), None)
    for r in rows:
        r["efficiency"] = r["samples_per_s"] / (r["devices"] * base) if base else None


def format_table(result: dict[str, Any]) -> str:
    """The scaling rows as text: devices, samples/s, efficiency, MFU and each part's share of
    the fit's time."""
    m = result.get("machine") or {}
    lines = [f"meshfit bench --scaling {result['recipe']} on {m.get('device_kind', '?')} "
             f"({m.get('platform', '?')}), {result['date']}",
             f"{'devices':>7}  {'batch':>6}  {'samples/s':>10}  {'vs linear':>9}  {'MFU':>6}  "
             "where the fit's time went"]
    for r in result["rows"]:
        parts = r.get("goodput_seconds") or {}
        total = sum(max(v, 0.0) for v in parts.values()) or 1.0
        shares = ", ".join(f"{goodput.LABELS.get(p, p)} {parts[p] / total:.0%}" for p in goodput.PARTS
                           if parts.get(p, 0.0) / total >= 0.005)
        sim = "*" if r.get("simulated") else " "
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
        lines.append(f"{r['devices']:>6}{sim}  {r['global_batch']:>6}  {r['samples_per_s']:>10,.0f}  "
                     f"{r['efficiency'] or 0:>9.2f}  {mfu:>6}  {shares}")
    if any(r.get("simulated") for r in result["rows"]):
        lines.append("* simulated devices sharing the CPU's cores: no speed-up is possible, the "
                     "figures show what more devices cost")
    return "\n".join(lines + [f"skipped {s}" for s in result["skipped"]])


def plot(result: dict[str, Any], path: str | None = None):
    """samples/s against devices with the linear ideal, and each count's fit time stacked by
    goodput part; saved as a PNG at `path` when given; returns the Figure."""
    rows = result["rows"]
    figure = figures.new(figsize=(11, 4.2), dpi=100, layout="constrained")
    left, right = figure.subplots(1, 2)
    devices = [r["devices"] for r in rows]
    left.plot(devices, [r["samples_per_s"] for r in rows], "o-", label="measured")
    base = next((r["samples_per_s"] for r in rows if r["devices"] == 1), None)
    if base:
        left.plot(devices, [base * n for n in devices], "--", color="grey", label="linear")
    for r in rows:
        if r.get("efficiency"):
            left.annotate(f"{r['efficiency']:.2f}", (r["devices"], r["samples_per_s"]),
                          textcoords="offset points", xytext=(4, 4), fontsize=8)
    left.set_xscale("log", base=2)
    left.set_xticks(devices, [str(n) for n in devices])
    left.set_xlabel("devices")
    left.set_ylabel("training samples/s (label: efficiency vs linear)")
    left.grid(alpha=0.3)
    left.legend()
    for i, r in enumerate(rows):
        parts = r.get("goodput_seconds") or {}
        start = 0.0
        for part in goodput.PARTS:
            width = max(parts.get(part, 0.0), 0.0)
            right.bar(i, width, bottom=start, color=goodput.COLORS[part],
                      label=goodput.LABELS.get(part, part) if i == 0 else None)
            start += width
    right.set_xticks(range(len(rows)), [str(n) for n in devices])
    right.set_xlabel("devices")
    right.set_ylabel("seconds of the fit (warm-up + timed epochs)")
    right.legend(fontsize="small")
    m = result.get("machine") or {}
    figure.suptitle(f"meshfit bench --scaling {result['recipe']} on {m.get('device_kind', '?')}",
                    fontsize=10)
    if path is not None:
        figure.savefig(path)
    return figure


def main_line(result: dict[str, Any]) -> str:
    """The 'wrote ...' line."""
    return "wrote " + ", ".join(os.path.join(result["out"], f) for f in ("scaling.json", "scaling.png"))
