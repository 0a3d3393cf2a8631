"""Train the EAGLE-3 draft with training-time test (TTT) on extracted hidden states.

Loss: eagle3flow/train/loss.py, ``train.loss`` eagle3flow/train/objective.py. The teacher
head is the target lm_head's ``t2d`` rows ``[Vd, H]``, so the full target vocab (e.g.
163840) is never materialised; the acceptance losses also hold the other rows, whose
logits only enter a logsumexp one chunk of rows at a time. The draft
is built from the target by eagle3flow/train/build.py; its optimizer and LR schedule
are eagle3flow/train/optim.py's.

Resumable (eagle3flow/train/checkpoint.py): checkpoints go to
``cache_root/<fingerprint>/step-XXXXXXXX/state.pt`` (trainable params, optimizer,
scheduler, data position, RNG states), written atomically; a killed run continues from
the latest one and, on CPU, reproduces the uninterrupted run's losses bitwise. The
fingerprint covers the data manifests' checksums, the vocab map, the target and the
training config. ``done.json`` in the run directory, written after the final
checkpoint and the outputs, marks a finished run: a rerun returns at once (without
reading a shard).

Chained runs (streaming partitions, eagle3flow/ops/streaming.py): ``--init-from`` starts
from another run's checkpoint (weights, optimizer, scheduler, RNG, global step and the
metrics so far), ``--schedule-tokens`` spreads the LR schedule over every link's
tokens instead of this manifest's, and ``--data-epoch`` numbers the epoch (the
shuffle's seed). All three enter the fingerprint, so each link has its own run
directory and resumes there after a kill.

Data order and batches: eagle3flow/train/data.py. ``batch_tokens`` is the GLOBAL
batch: under torchrun (``python -m eagle3flow.train.launch``, eagle3flow/train/distributed.py)
each of the N ranks trains on its share of every batch and the gradients are summed,
so the samples of a step, their order and the loss normalisation are those of one
process; checkpoints hold no per-rank state and resume under any world size. Only
rank 0 writes checkpoints, metrics and outputs.

Precision: bf16 autocast on CUDA (the frozen embeddings and the teacher head stored
in bf16), fp32 on CPU.

Observability (eagle3flow/train/metrics.py): one metrics line per ``log_every`` steps
(loss, per-step loss and accuracy, tokens/s over all ranks, MFU per
eagle3flow/model/flops.py with its denominators named, the time the loop waited for
data); the progress line prints the same with an ETA. At every checkpoint the eval
split's acceptance length is computed as greedy decoding would measure it (the decode
walk of eagle3flow/train/eval_split.py, capped by ``eval_max_tokens``); the best
checkpoint is kept besides the last ``keep_checkpoints``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3flow.atomic import sweep_stale_temporaries, write_json
from eagle3flow.config import cli_settings, section_settings
from eagle3flow.device import limit_cpu_threads
from eagle3flow.extract.shards import Manifest, load_manifest
from eagle3flow.model.flops import PeakFlops, mean_causal_context, train_flops_per_token
from eagle3flow.model.kernels.fp8_linear import fp8_device
from eagle3flow.model.optimizer_flops import optimizer_flops_per_step
from eagle3flow.progress import Progress
from eagle3flow.train.build import build_draft, load_unreachable_head, load_vocab_map
from eagle3flow.train.checkpoint import (RunState, chain_settings, finished_result, fingerprint,
                                         init_state_path, list_checkpoints, read_state, restore_training_state,
                                         save_checkpoint, training_state, write_done)
from eagle3flow.train.config import TRAIN_DEFAULTS
from eagle3flow.train.data import BatchLoader, EpochPlans, ShardData, rank_share
from eagle3flow.train.distributed import DistContext, init_distributed, sum_gradients
from eagle3flow.train.eval_split import evaluate_split
from eagle3flow.train.loss import ttt_loss
from eagle3flow.train.metrics import TrainMetrics, read_metrics, start_metrics_files
from eagle3flow.train.objective import Objective
from eagle3flow.train.optim import build_optimizers, build_schedule
from eagle3flow.train.trackers import Trackers


def train(train_manifest: str | Path, eval_manifest: str | Path | None, vocab_map: str | Path,
          target_path: str | Path, out_dir: str | Path, cache_root: str | Path,
          config: dict | None = None, init_from: str | Path | None = None,
          schedule_tokens: int | None = None, data_epoch: int = 0) -> dict:
    """Train (or resume) and write the declared outputs into ``out_dir``; returns eval.json's dict.

    Under torchrun every rank calls this; rank 0 writes and returns the result, the
    others return ``{}``. ``init_from``: a checkpoint (``.../step-XXXXXXXX[/state.pt]``)
    to start from when this run has none of its own; ``schedule_tokens``: the tokens the
    LR schedule spans (default: this manifest's x epochs, counted in steps); ``data_epoch``:
    the number of this run's first epoch (seeds the shuffle).
    """
    cfg = section_settings("train", config)
    Objective.of(cfg)    # a bad loss is refused before any model loads
    if schedule_tokens is not None and int(schedule_tokens) < 1:
        raise ValueError(f"schedule_tokens must be >= 1, got {schedule_tokens}")
    if int(data_epoch) < 0:
        raise ValueError(f"data_epoch must be >= 0, got {data_epoch}")
    ctx = init_distributed(cfg["device"])
    try:
        return train_rank(ctx, cfg, train_manifest, eval_manifest, vocab_map, target_path,
                          Path(out_dir), Path(cache_root), init_from, schedule_tokens, int(data_epoch))
    finally:
        ctx.close()


def bf16_autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


class Trainer:
    """The draft and its teacher head, optimizer, LR schedule and batch plan, and where the
    run stands (``run``: :class:`RunState`). :meth:`restore` continues from a checkpoint,
    :meth:`train_step` trains one global batch, :meth:`save` writes a checkpoint."""

    def __init__(self, ctx: DistContext, cfg: dict, manifest: Manifest, vocab_map, target_path,
                 schedule_tokens: int | None, data_epoch: int, log):
        self.ctx, self.cfg, self.log = ctx, cfg, log
        self.num_steps = cfg["ttt_steps"]
        d2t, t2d = load_vocab_map(vocab_map)
        device = self.device = ctx.device
        self.autocast = device.type == "cuda"
        # The gradients come out of bf16 autocast on CUDA: a bf16 all-reduce halves the bytes.
        self.reduce_dtype = {"auto": torch.bfloat16 if self.autocast else None, "float32": None,
                             "bfloat16": torch.bfloat16}[cfg["grad_reduce_dtype"]]
        model, teacher_head = build_draft(target_path, manifest.aux_layer_ids, d2t, t2d, cfg["draft"], cfg["seed"])
        if manifest.hidden_size != model.config.target_hidden_size:
            raise ValueError(f"{manifest.path}: hidden_size {manifest.hidden_size} != target hidden size "
                             f"{model.config.target_hidden_size}")
        if self.autocast:
            # Frozen and only looked up: bf16 is what autocast computes with anyway, at half the memory.
            model.embed_tokens.to(torch.bfloat16)
        self.model = model.to(device).train()
        model.fp8_matmuls = cfg["fp8_matmuls"]
        if model.fp8_matmuls:
            log("train: the layer's GEMMs in fp8 (train.fp8_matmuls)"
                + ("" if fp8_device(device) else ": not on this GPU (no fp8 tensor cores), bf16"))
        self.teacher_head = teacher_head.to(device, torch.bfloat16 if self.autocast else torch.float32)
        self.objective = Objective.of(cfg)
        self.unreachable_head = None
        if self.objective.needs_target_mass:
            self.unreachable_head = load_unreachable_head(target_path, t2d).to(device, self.teacher_head.dtype)
        if not self.objective.is_forward_kl:
            outside = "" if self.unreachable_head is None else \
                f", the target's {self.unreachable_head.shape[0]} tokens outside the draft vocab held for its normaliser"
            log(f"train: loss {dict(self.objective.weights)} at temperature {self.objective.temperature}"
                + (f", lk_hybrid_eta {self.objective.hybrid_eta}" if self.objective.needs_step_acceptance else "")
                + outside)
        named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named_params]
        ctx.broadcast_(self.params)
        self.optimizer = build_optimizers(named_params, cfg, device, (ctx.rank, ctx.world_size))

        self.data = ShardData(manifest)
        self.last_evaluation: tuple[int, dict] | None = None   # (step, its evaluation)
        self.plan = EpochPlans(self.data, cfg["seed"], cfg["batch_tokens"], data_epoch)
        self.steps_per_epoch = [len(self.plan(e)) for e in range(cfg["epochs"])]
        self.run = RunState()
        self.scheduler = build_schedule(self.optimizer, cfg, sum(self.steps_per_epoch), schedule_tokens,
                                        lambda: self.run.tokens_done)

    @property
    def total_steps(self) -> int:
        return self.run.base_step + sum(self.steps_per_epoch)

    def restore(self, run_dir: Path, init_from) -> Path | None:
        """Continue from this run's latest checkpoint, else from ``init_from`` (a chained run's
        start), else start afresh. Returns the metrics file the history starts with when it
        is another run's (``init_from``'s)."""
        checkpoints = list_checkpoints(run_dir)
        history_from = None
        if checkpoints:
            state = read_state(checkpoints[-1][1] / "state.pt")
            self.run = RunState.resumed(state)
            self.log(f"train: resuming from {checkpoints[-1][1]} (step {self.run.step}/{self.total_steps}, "
                     f"saved by {state.get('world_size', 1)} process(es), now {self.ctx.world_size})")
        elif init_from is not None:
            init_path = init_state_path(init_from)
            state = read_state(init_path)
            self.run = RunState.chained(state)
            history_from = init_path.parent.parent / "metrics.jsonl"
            self.log(f"train: starting from {init_path.parent} (step {self.run.step}, "
                     f"{state.get('tokens_done', 0):,} tokens of the chain trained)")
        else:
            return None
        restore_training_state(state, self.model, self.optimizer, self.scheduler)
        return history_from

    def remaining(self) -> list[tuple[int, int]]:
        """``(epoch, batch index)`` of every global batch still to train, in order."""
        run, epochs = self.run, self.cfg["epochs"]
        return [(e, b) for e in range(run.epoch, epochs)
                for b in range(run.batch_index if e == run.epoch else 0, self.steps_per_epoch[e])]

    def train_step(self, batch: dict, global_tokens: int) -> dict:
        """One optimizer step on this rank's share ``batch`` of a global batch of ``global_tokens``."""
        cfg, num_steps, model = self.cfg, self.num_steps, self.model
        # Divide each step's loss by the scored rows of the whole global batch.
        counts = self.ctx.all_reduce_sum(batch["step_rows"].clone()).tolist()
        denominators = [max(1, int(c)) for c in counts]
        loss, stats = None, [(0.0, 0.0, 0)] * num_steps
        if batch["input_ids"].numel():
            loss, stats = ttt_loss(model, batch, self.teacher_head, num_steps, cfg["step_loss_decay"],
                                   self.autocast, denominators=denominators, objective=self.objective,
                                   unreachable_head=self.unreachable_head, reduce_sum=self.ctx.all_reduce_sum)
        elif self.objective.needs_step_acceptance:
            # lk_hybrid's blend sums acceptance over ranks: a rank without rows still takes part.
            self.ctx.all_reduce_sum(torch.zeros(num_steps, device=self.device))
        self.optimizer.zero_grad(set_to_none=True)
        if loss is not None and loss.requires_grad:
            loss.backward()
        sum_gradients(self.params, self.ctx, self.reduce_dtype)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg["max_grad_norm"])
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.run.tokens_done += global_tokens
        self.scheduler.step()
        self.run.step += 1
        return {"loss": loss, "stats": stats, "counts": counts, "grad_norm": grad_norm, "lr": lr}

    def evaluate(self, eval_split: Manifest) -> dict:
        # the draft as it is served: bf16 GEMMs, whatever train.fp8_matmuls trains with
        fp8, self.model.fp8_matmuls = self.model.fp8_matmuls, False
        try:
            with bf16_autocast(self.device):
                return evaluate_split(self.model, eval_split, self.num_steps, self.cfg["eval_max_tokens"],
                                      teacher_head=self.teacher_head.float(), batch_tokens=self.cfg["batch_tokens"],
                                      temperature=(self.cfg["checkpoint_temperature"] if self.picks_at_temperature
                                                   else None))
        finally:
            self.model.fp8_matmuls = fp8

    @property
    def picks_at_temperature(self) -> bool:
        """train.checkpoint_metric rejection_estimate: the best checkpoint is the one with the
        highest expected acceptance under rejection sampling (else: the decode walk)."""
        return self.cfg.get("checkpoint_metric", "decode_walk") == "rejection_estimate"

    def save(self, run_dir: Path, fp: str, next_epoch: int, next_batch: int, eval_split: Manifest | None,
             metrics: TrainMetrics) -> None:
        """Evaluate (when there is an eval split, keeping the best), then write the checkpoint
        whose data position is ``(next_epoch, next_batch)``."""
        run, num_steps = self.run, self.num_steps
        if eval_split is not None:
            evaluated = self.evaluate(eval_split)
            metric = "rejection_estimate" if self.picks_at_temperature else "decode_walk"
            acceptance = evaluated["rejection_acceptance_length" if self.picks_at_temperature
                                   else "decode_acceptance_length"][str(num_steps)]
            if run.best is not None and run.best.get("metric", "decode_walk") != metric:
                run.best = None     # resumed under another metric: its best is not comparable
            if acceptance is not None and (run.best is None or acceptance > run.best["acceptance_length"]):
                run.best = {"step": run.step, "acceptance_length": acceptance, "num_speculative_tokens": num_steps,
                            # Only where it is not the default: best.json stays as it was.
                            **({"metric": metric, "temperature": self.cfg["checkpoint_temperature"]}
                               if self.picks_at_temperature else {})}
            what = (f"rejection estimate at T={self.cfg['checkpoint_temperature']:g}" if self.picks_at_temperature
                    else "decode walk")
            self.log(f"train: step {run.step} eval acceptance length ({what}, K={num_steps}) {acceptance}; "
                     f"best {run.best}")
            metrics.evaluation(run.step, evaluated)
            self.last_evaluation = (run.step, evaluated)
        batches = self.plan(next_epoch) if next_epoch < self.cfg["epochs"] else []
        next_sample = batches[next_batch][0] if next_batch < len(batches) else None
        state = training_state(self.model, self.optimizer, self.scheduler, run, next_epoch, next_batch,
                               next_sample, fp, self.ctx.world_size)
        save_checkpoint(run_dir, run.step, state, self.cfg["keep_checkpoints"], run.best["step"] if run.best else None)
        if run.best is not None:
            write_json(run_dir / "best.json", {**run.best, "checkpoint": str(run_dir / f"step-{run.best['step']:08d}")})


def train_rank(ctx: DistContext, cfg: dict, train_manifest, eval_manifest, vocab_map, target_path,
               out_dir: Path, cache_root: Path, init_from=None, schedule_tokens: int | None = None,
               data_epoch: int = 0) -> dict:
    """:func:`train` on this rank, once the process group is up."""
    manifest = load_manifest(train_manifest)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if ctx.is_main else (lambda msg: None)
    chain = chain_settings(init_from, schedule_tokens, data_epoch)
    fp = fingerprint(manifest, vocab_map, target_path, cfg, chain)
    run_dir = cache_root / fp
    finished = finished_result(run_dir, out_dir, fp)
    if finished is not None:
        # A rerun of a finished run (e.g. killed after it, while its shards were deleted).
        log(f"train: already finished in {run_dir} (step {finished['steps']}); nothing to do")
        return finished if ctx.is_main else {}
    trainer = Trainer(ctx, cfg, manifest, vocab_map, target_path, schedule_tokens, data_epoch, log)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        # A checkpoint whose writer was killed (SIGTERM mid-save runs no cleanup): a
        # whole state's bytes, never resumed from; gone before this run saves its own.
        for path, size in sweep_stale_temporaries(run_dir):
            log(f"train: removed the unfinished checkpoint {path.name} of a killed run ({size / 1e6:,.1f} MB)")
        write_json(run_dir / "config.json", {"train_config": cfg, "draft_config": trainer.model.config.to_dict(),
                                             "train_manifest": str(train_manifest), "chain": chain})
    history_from = trainer.restore(run_dir, init_from)
    total_steps = trainer.total_steps
    metrics_paths = (run_dir / "metrics.jsonl", out_dir / "metrics.jsonl")
    if ctx.is_main:
        start_metrics_files(metrics_paths, read_metrics(history_from or metrics_paths[0], trainer.run.step))
    eval_split = None if eval_manifest is None else load_manifest(eval_manifest)

    # The remaining global batches, in order, and this rank's share of each.
    data, device, num_steps = trainer.data, trainer.device, trainer.num_steps
    positions = trainer.remaining()
    shares, global_tokens = [], []
    for e, b in positions:
        batch = trainer.plan(e)[b]
        shares.append(rank_share(batch, data.lengths, ctx.rank, ctx.world_size))
        global_tokens.append(sum(data.lengths[s][i] for s, i in batch))
    workers = cfg["data_workers"] if cfg["data_workers"] is not None else (4 if device.type == "cuda" else 0)
    loader = BatchLoader(data, shares, num_steps, device, workers, cfg["prefetch_batches"])

    all_lengths = [n for shard in data.lengths for n in shard]
    flops = train_flops_per_token(trainer.model.config, num_steps, mean_causal_context(all_lengths))
    flops_per_token = flops["total"]
    flops["optimizer_per_step"] = optimizer_flops_per_step(trainer.model.config, cfg["optimizer"])
    muon = (f" + {flops['optimizer_per_step'] / 1e12:.3g} TFLOP per optimizer step (Muon's Newton-Schulz"
            f"{f', shared by {ctx.world_size} processes' if ctx.enabled else ''})"
            if flops["optimizer_per_step"] else "")
    peak = PeakFlops(device, cfg["peak_flops"])
    log(f"train: {ctx.world_size} process(es) on {device.type}, {total_steps} steps of <= "
        f"{cfg['batch_tokens']} tokens, {flops_per_token / 1e9:.3f} GFLOP/token with every row scored "
        f"({trainer.model.config.architecture} draft){muon}, MFU against {peak.rate_text()} per device")

    trackers = Trackers(cfg["report_to"] if ctx.is_main else [], out_dir, fp, cfg)
    metrics = TrainMetrics(ctx, metrics_paths, trackers, peak, flops, num_steps)
    progress = Progress("train", data.num_tokens * cfg["epochs"], unit="tokens",
                        done=data.num_tokens * cfg["epochs"] - sum(global_tokens),
                        stream=sys.stderr if ctx.is_main else open(os.devnull, "w"))
    delay = float(os.environ.get("EAGLE3FLOW_TEST_STEP_DELAY", "0") or 0)
    for k, (epoch, batch_index) in enumerate(positions):
        batch = loader.next()
        metrics.waited(loader.wait_s)
        result = trainer.train_step(batch, global_tokens[k])
        metrics.step(global_tokens[k], sum(result["counts"]))
        step = trainer.run.step
        if step % cfg["log_every"] == 0 or step == total_steps:
            metrics.line(step, data_epoch + epoch, result["loss"], result["stats"], result["counts"],
                         result["grad_norm"], result["lr"], global_tokens[k])
        progress.update(global_tokens[k], extra=f"step {step}/{total_steps} {metrics.text}")
        if step % cfg["checkpoint_every"] == 0 or step == total_steps:
            if ctx.is_main:
                at_end = batch_index + 1 == trainer.steps_per_epoch[epoch]
                trainer.save(run_dir, fp, epoch + 1 if at_end else epoch, 0 if at_end else batch_index + 1,
                             eval_split, metrics)
        if delay:
            time.sleep(delay)
    progress.close()
    metrics.close()
    if not ctx.is_main:
        return {}
    return write_outputs(trainer, out_dir, run_dir, fp, chain, flops_per_token, eval_split)


def write_outputs(trainer: Trainer, out_dir: Path, run_dir: Path, fp: str, chain: dict | None,
                  flops_per_token: float, eval_split: Manifest | None) -> dict:
    """``draft.safetensors``, ``draft_config.json`` and ``eval.json`` in ``out_dir``, then
    ``done.json`` in the run directory; returns eval.json's dict."""
    model, run = trainer.model, trainer.run
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().float().contiguous() if v.is_floating_point() else v.detach().cpu().contiguous()
               for k, v in model.trainable_state_dict().items()},
              str(out_dir / "draft.safetensors"), metadata={"fingerprint": fp})
    write_json(out_dir / "draft_config.json", model.config.to_dict())
    result = {"train_config": trainer.cfg, "fingerprint": fp, "steps": run.step, "world_size": trainer.ctx.world_size,
              "flops_per_token": flops_per_token, "best_checkpoint": run.best,
              "tokens_done": run.tokens_done, "chain": chain,
              "final_checkpoint": str(run_dir / f"step-{run.step:08d}")}
    if eval_split is not None:
        # The last checkpoint evaluated these weights already, unless this process resumed after it.
        last = trainer.last_evaluation
        result.update(last[1] if last and last[0] == run.step else trainer.evaluate(eval_split))
        trainer.log(f"train: eval step accuracy {result['step_accuracy']}, acceptance length (decode walk) "
                    f"{result['decode_acceptance_length']}")
    write_json(out_dir / "eval.json", result)
    # Last: the final checkpoint and the outputs are on disk.
    write_done(run_dir, out_dir, fp, run.step, run.tokens_done, result["final_checkpoint"])
    return result


def main(argv=None) -> None:
    """CLI. ``--config-json`` is the workflow's ``train`` config section (keys: TRAIN_DEFAULTS)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-manifest", required=True)
    parser.add_argument("--eval-manifest", default=None)
    parser.add_argument("--vocab-map", required=True)
    parser.add_argument("--target", required=True, help="target model dir (embeddings, norm, lm_head)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--cache-root", required=True)
    parser.add_argument("--config-json", default="{}", help=f"the train section: JSON with keys of {sorted(TRAIN_DEFAULTS)}")
    parser.add_argument("--init-from", default=None,
                        help="chained run: start from this checkpoint (.../step-XXXXXXXX) when "
                             "this run has none of its own")
    parser.add_argument("--schedule-tokens", type=int, default=None,
                        help="chained run: tokens the LR schedule spans (every link's)")
    parser.add_argument("--data-epoch", type=int, default=0,
                        help="chained run: the number of this run's first epoch (seeds the shuffle)")
    args = parser.parse_args(argv)
    config = cli_settings(parser, "train", args.config_json)
    limit_cpu_threads()
    train(args.train_manifest, args.eval_manifest, args.vocab_map, args.target, args.out_dir,
          args.cache_root, config, init_from=args.init_from, schedule_tokens=args.schedule_tokens,
          data_epoch=args.data_epoch)


if __name__ == "__main__":
    main()
