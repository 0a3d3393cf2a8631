"""The plan as the text table the workflow prints before any job (and, with the measured
columns, after the run)."""
from __future__ import annotations

from eagle3flow.ops.plan.stages import Plan
from eagle3flow.ops.plan.sizes import format_bytes


def format_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"



def render(plan: Plan, actual: bool = False) -> str:
    """The plan as a text table; with ``actual`` the measured columns beside the projected."""
    head = ["stage", "status", "disk", "time", "GPU-h"]
    if actual:
        head[3:3] = ["disk (actual)"]
        head[5:5] = ["time (actual)"]
    lines = []
    gpu_factor = max(plan.gpus, 1) if plan.gpus else 0
    for s in plan.stages:
        status = s.status if s.status != "run" or not s.jobs or s.jobs == 1 else f"run ({s.jobs} jobs)"
        cells = [s.name + (" [GPU]" if s.gpu else ""), status, format_bytes(s.bytes),
                 format_seconds(s.seconds),
                 f"{s.seconds * gpu_factor / 3600:.2f}" if s.gpu and gpu_factor else "-"]
        if actual:
            cells[3:3] = [format_bytes(s.actual_bytes)]
            cells[5:5] = [format_seconds(s.actual_seconds)]
        lines.append(cells)
    widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = ["=== plan (eagle3flow.ops.plan) ===", fmt(head), fmt(["-" * w for w in widths])]
    out += [fmt(r) for r in lines]
    run_s = sum(s.seconds for s in plan.stages if s.status == "run")
    out.append(f"peak disk (results/ + cache/): {format_bytes(plan.peak_bytes)} projected"
               + (f", {format_bytes(plan.actual_peak_bytes)} measured" if plan.actual_peak_bytes else "")
               + f"; still to write {format_bytes(plan.to_write_bytes)}"
               + (f"; already there, outside the stages: {format_bytes(plan.other_bytes)}" if plan.other_bytes else ""))
    out.append(f"time of the stages that run: {format_seconds(run_s)} (one after another); "
               f"GPU-hours: {plan.gpu_seconds * gpu_factor / 3600:.2f} on {plan.gpus} GPU(s); "
               + (f"production downtime: {format_seconds(plan.downtime_seconds)} (GPU stages behind the drain, then the unit's restart)"
                  if plan.drain else "no production service drained"))
    w = plan.workload
    out.append(f"from: {w['train_tokens']:,} train + {w['eval_tokens']:,} eval tokens ({w['basis']}); "
               f"target {w['target']}; {w['hidden_state_bytes_per_token']:,} B/token of hidden states "
               f"({w['storage_dtype']}); draft {w['draft_params']:,} trainable params")
    for s in plan.stages:
        out.append(f"  {s.name}: disk = {s.bytes_basis}; time = {s.time_basis}")
    out += plan.notes
    return "\n".join(out)


