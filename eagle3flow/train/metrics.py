"""What a training run reports: one metrics line per ``log_every`` steps (loss, per-step
loss and accuracy, grad norm, lr, tokens/s over all ranks, MFU (FLOPs and their
denominators: eagle3flow/model/flops.py), the time the loop waited for data) into
``metrics.jsonl`` (in the run directory and in ``out_dir``) and the trackers
(eagle3flow/train/trackers.py), and the evaluations at checkpoints. A resumed run's file
keeps the lines up to its checkpoint's step and drops the ones it redoes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from eagle3flow.model.flops import PeakFlops
from eagle3flow.train.distributed import DistContext
from eagle3flow.train.trackers import Trackers, flatten


def read_metrics(path: Path, up_to_step: int) -> list[str]:
    """Metrics lines with ``step <= up_to_step`` (a resumed run drops what it will redo)."""
    if not path.is_file():
        return []
    lines = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue            # a line cut short by a kill
            if row.get("step", 0) <= up_to_step:
                lines.append(line)
    return lines



def start_metrics_files(paths: tuple[Path, ...], history: list[str]) -> None:
    """Each of ``paths`` rewritten to hold ``history`` (:func:`read_metrics`) alone."""
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in history))


class TrainMetrics:
    """The metrics lines of a run. Every rank calls :meth:`step` after each optimizer step
    and :meth:`line` at the same steps (it sums over ranks); only the main rank writes.
    ``text`` is the last line in short, for the progress line. ``flops``: the run's
    :func:`eagle3flow.model.flops.train_flops_per_token` (its ``per_row`` and ``per_scored``:
    a step's FLOPs follow the rows its loss scores) and ``optimizer_per_step``, the
    optimizer's products per step, shared by the ranks
    (:func:`eagle3flow.model.optimizer_flops.optimizer_flops_per_step`)."""

    def __init__(self, ctx: DistContext, paths: tuple[Path, ...], trackers: Trackers, peak: PeakFlops,
                 flops: dict, num_steps: int):
        self.ctx, self.paths, self.trackers, self.peak = ctx, paths, trackers, peak
        self.flops, self.num_steps = flops, num_steps
        self.text = ""
        self.reset_window(time.perf_counter())

    def reset_window(self, now: float) -> None:
        """Tokens, scored rows, steps and data-wait time since the last metrics line (the rates' window)."""
        self.window_tokens, self.window_scored, self.window_steps = 0, 0, 0
        self.window_wait, self.window_t0 = 0.0, now

    def waited(self, seconds: float) -> None:
        self.window_wait += seconds

    def step(self, tokens: int, scored_rows: int) -> None:
        """A global batch of ``tokens`` trained, its loss scored on ``scored_rows`` (all TTT steps)."""
        self.window_tokens += tokens
        self.window_scored += scored_rows
        self.window_steps += 1

    def line(self, step: int, epoch: int, loss: torch.Tensor | None, stats: list[tuple[float, float, int]],
             counts: list[float], grad_norm: float, lr: float, tokens: int) -> dict:
        """The metrics row of ``step``. ``stats [K]``: this rank's (loss, accuracy, scored rows)
        per TTT step; ``counts [K]``: the global batch's scored rows per step."""
        num_steps, ctx = self.num_steps, self.ctx
        local = torch.tensor([0.0 if loss is None else float(loss.detach()), self.window_wait]
                             + [s[0] for s in stats] + [round(s[1] * s[2]) for s in stats],
                             dtype=torch.float64)
        summed = ctx.all_reduce_sum(local).tolist()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        now = time.perf_counter()
        seconds = max(now - self.window_t0, 1e-9)
        tokens_per_s = self.window_tokens / seconds
        # Muon's Newton-Schulz runs once per step, whatever the batch, each matrix on one rank.
        flops = (self.window_tokens * self.flops["per_row"] + self.window_scored * self.flops["per_scored"]
                 + self.window_steps * self.flops.get("optimizer_per_step", 0.0))
        row = {"step": step, "epoch": epoch, "loss": summed[0],
               "step_loss": summed[2:2 + num_steps],
               "step_acc": [h / c if c else 0.0 for h, c in zip(summed[2 + num_steps:], counts)],
               "step_rows": [int(c) for c in counts], "grad_norm": float(grad_norm), "lr": lr,
               "tokens": tokens, "tokens_per_s": tokens_per_s,
               **self.peak.mfu(flops / seconds / ctx.world_size),
               "data_wait_s": summed[1] / ctx.world_size / self.window_steps,
               "world_size": ctx.world_size}
        self.reset_window(now)
        self.text = (f"loss {row['loss']:.4f} acc0 {row['step_acc'][0]:.3f} mfu {self.peak.describe(row)} "
                     f"data-wait {row['data_wait_s'] * 1e3:.1f} ms/step")
        if ctx.is_main:
            line = json.dumps(row)
            for path in self.paths:
                with open(path, "a") as f:
                    f.write(line + "\n")
            self.trackers.log(step, flatten("train", {k: v for k, v in row.items() if k not in ("step", "epoch")}))
        return row

    def evaluation(self, step: int, evaluated: dict) -> None:
        """An eval at a checkpoint (eagle3flow/train/eval_split.py's dict), to the trackers."""
        self.trackers.log(step, flatten("eval", {key: evaluated[key] for key in (
            "decode_acceptance_length", "simulated_acceptance_length", "step_accuracy",
            "rejection_acceptance_length") if key in evaluated}))

    def close(self) -> None:
        self.trackers.close()
