"""Training: it learns, it writes the declared outputs, and a killed run resumes bitwise."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3flow.train.build import load_trained
from eagle3flow.config import section_settings
from eagle3flow.train.eval_split import evaluate_split
from eagle3flow.train.trainer import train
from support.builders import TRAIN_CONFIG, losses, make_hidden_states, make_vocab_map
from support.fault_rows import record, yes

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable


@pytest.fixture(scope="module")
def train_inputs(random_llama_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_inputs")
    train_m = make_hidden_states(random_llama_target, root / "hs_train", 24, seed=0)
    eval_m = make_hidden_states(random_llama_target, root / "hs_eval", 6, seed=1)
    vmap = make_vocab_map(train_m, 512, 200, root / "vocab_map.safetensors")
    return {"train": train_m, "eval": eval_m, "vocab": vmap, "target": random_llama_target}


def test_train_learns_and_writes_outputs(train_inputs, tmp_path, capfd):
    out = tmp_path / "train"
    result = train(train_inputs["train"], train_inputs["eval"], train_inputs["vocab"],
                   train_inputs["target"], out, tmp_path / "cache", TRAIN_CONFIG)
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and result["steps"] == len(rows)
    first, last = rows[0], rows[-1]
    assert set(first) >= {"step", "epoch", "loss", "step_acc", "lr", "tokens_per_s"}
    # the MFU names what it divides by and is a fraction of it (None: the guard's "over 100%")
    log = capfd.readouterr().err
    # Muon (the default optimizer)'s Newton-Schulz products are counted apart, per step
    assert re.search(r"GFLOP/token with every row scored \(llama draft\) \+ [0-9.e+-]+ TFLOP per optimizer "
                     r"step \(Muon's Newton-Schulz\), MFU against ", log), log
    assert "TFLOP/s measured matmul per device" in log
    assert all(r["mfu_basis"] == "measured matmul" and (r["mfu"] is None or 0 < r["mfu"] <= 1) for r in rows)
    assert len(first["step_acc"]) == 3
    # the random target's teacher is near-uniform: its entropy (~5.3) dominates the loss
    assert sum(r["loss"] for r in rows[-4:]) < sum(r["loss"] for r in rows[:4]) - 0.02
    assert last["step_acc"][0] > first["step_acc"][0] + 0.2
    weights = load_file(str(out / "draft.safetensors"))
    assert "embed_tokens.weight" not in weights and weights["d2t"].numel() == 200
    assert json.loads((out / "draft_config.json").read_text())["draft_vocab_size"] == 200
    ev = json.loads((out / "eval.json").read_text())
    assert len(ev["step_accuracy"]) == 3 and set(ev["simulated_acceptance_length"]) == {"1", "2", "3"}
    # K=1 chains are scored on exactly step 0's rows
    assert ev["simulated_acceptance_length"]["1"] == pytest.approx(1 + ev["step_accuracy"][0])
    assert ev["simulated_acceptance_length"]["3"] >= 1.3      # it learned something
    assert set(ev["decode_acceptance_length"]) == {"1", "2", "3"} and ev["decode_acceptance_length"]["3"] > 1.1
    # the trained draft reloads and evaluates the same; an untrained one is worse
    model = load_trained(out, train_inputs["target"])
    again = evaluate_split(model, train_inputs["eval"], 3)
    assert again["step_accuracy"] == pytest.approx(ev["step_accuracy"])
    # checkpoints: the last two and the best by the decode walk's acceptance length (K=3) on the eval split
    run_dirs = list((tmp_path / "cache").iterdir())
    steps = sorted(p.name for p in run_dirs[0].glob("step-*"))
    best = ev["best_checkpoint"]
    assert best["acceptance_length"] >= ev["decode_acceptance_length"]["3"]
    expected = {f"step-{len(rows) - 3:08d}", f"step-{len(rows):08d}", f"step-{best['step']:08d}"}
    assert set(steps) == expected and json.loads((run_dirs[0] / "best.json").read_text())["step"] == best["step"]
    # a rerun after completion does not train again and rewrites the same outputs
    t0 = time.monotonic()
    train(train_inputs["train"], train_inputs["eval"], train_inputs["vocab"],
          train_inputs["target"], out, tmp_path / "cache", TRAIN_CONFIG)
    assert [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()] == rows


def test_train_learns_with_fp8_matmuls(train_inputs, tmp_path, capfd):
    """train.fp8_matmuls through the trainer (the kernels' CPU emulation): the log says so, it
    learns, its losses differ from the bf16 path's (the casts are really taken), and its
    evaluation scores the draft as it is served, without fp8."""
    runs = {}
    for fp8 in (False, True):
        out = tmp_path / f"train-{fp8}"
        ev = train(train_inputs["train"], train_inputs["eval"], train_inputs["vocab"], train_inputs["target"], out,
                   tmp_path / f"cache-{fp8}", {**TRAIN_CONFIG, "epochs": 3, "fp8_matmuls": fp8,
                                              # a score of probabilities: fp8's noise would show in it
                                              "checkpoint_metric": "rejection_estimate",
                                              "checkpoint_temperature": 0.6})
        runs[fp8] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "the layer's GEMMs in fp8 (train.fp8_matmuls)" in capfd.readouterr().err
    served = evaluate_split(load_trained(out, train_inputs["target"]), train_inputs["eval"], 3, temperature=0.6)
    assert served["rejection_acceptance_length"] == pytest.approx(ev["rejection_acceptance_length"], rel=1e-6)
    plain, fp8 = runs[False], runs[True]
    assert len(fp8) == len(plain) and fp8 != plain
    assert sum(fp8[-3:]) < sum(fp8[:3]) - 0.02
    assert fp8[-1] == pytest.approx(plain[-1], rel=0.05)


def test_checkpoints_can_be_picked_by_the_rejection_estimate_at_temperature(train_inputs, tmp_path):
    """train.checkpoint_metric rejection_estimate: the best checkpoint is the one with the
    highest expected acceptance under rejection sampling at checkpoint_temperature, and
    best.json says so; the run's cache key is the default's (only the pick changed)."""
    from eagle3flow.train.checkpoint import fingerprint
    from eagle3flow.extract.shards import load_manifest

    config = {**TRAIN_CONFIG, "checkpoint_metric": "rejection_estimate", "checkpoint_temperature": 0.6}
    out = tmp_path / "train"
    train(train_inputs["train"], train_inputs["eval"], train_inputs["vocab"], train_inputs["target"], out,
          tmp_path / "cache", config)
    ev = json.loads((out / "eval.json").read_text())
    best = ev["best_checkpoint"]
    assert best["metric"] == "rejection_estimate" and best["temperature"] == 0.6
    assert 1.0 <= best["acceptance_length"] <= 4.0
    run_dir = next((tmp_path / "cache").iterdir())
    assert json.loads((run_dir / "best.json").read_text())["metric"] == "rejection_estimate"
    manifest = load_manifest(train_inputs["train"])
    assert fingerprint(manifest, train_inputs["vocab"], train_inputs["target"], section_settings("train", config)) \
        == fingerprint(manifest, train_inputs["vocab"], train_inputs["target"], section_settings("train", TRAIN_CONFIG))


# The trainer CLI whose second checkpoint is held once its bytes are in the temporary
# folder, before it is synced and renamed: the signal lands mid-write.
HELD_IN_SECOND_CHECKPOINT_WRITE = """
import sys, time, torch
from eagle3flow.train.trainer import main
save, saved = torch.save, []
def held(obj, f, *args, **kwargs):
    save(obj, f, *args, **kwargs)
    saved.append(f)
    if len(saved) == 2:
        print("writing", f.name, flush=True)
        time.sleep(300)
torch.save = held
main(sys.argv[1:])
"""


def run_cli(inputs, out, cache, wait=True, held: bool = False):
    args = ["--train-manifest", str(inputs["train"]),
            "--vocab-map", str(inputs["vocab"]), "--target", str(inputs["target"]),
            "--out-dir", str(out), "--cache-root", str(cache),
            "--config-json", json.dumps({**TRAIN_CONFIG, "epochs": 4, "checkpoint_every": 2})]
    cmd = [PY, "-c", HELD_IN_SECOND_CHECKPOINT_WRITE, *args] if held else [PY, "-m", "eagle3flow.train.trainer", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if wait:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        return output
    return proc


def test_killed_run_resumes_bitwise(train_inputs, tmp_path):
    """SIGTERM while a checkpoint is being written (the job signalled; Python's default
    action runs no cleanup, as SIGKILL), past the metrics of two more steps: the rerun
    removes the unfinished checkpoint, resumes from the last finished one and trains
    exactly what an uninterrupted run trains."""
    run_cli(train_inputs, tmp_path / "ref_out", tmp_path / "ref_cache")
    reference = losses(tmp_path / "ref_out")
    assert len(reference) >= 8

    cache = tmp_path / "cache"
    proc = run_cli(train_inputs, tmp_path / "out", cache, wait=False, held=True)
    unfinished = lambda: sorted(p.name for p in cache.glob("*/.step-*.tmp-*"))  # noqa: E731
    try:
        assert any(line.startswith("writing") for line in proc.stdout), "the second checkpoint was never written"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    finished = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.glob("*/step-*/state.pt")}
    left = unfinished()
    partial = losses(tmp_path / "out")
    assert 2 < len(partial) < len(reference) and len(finished) == 1 and left, (partial, finished, left)
    output = run_cli(train_inputs, tmp_path / "out", cache)
    rewritten = [p for p, ident in finished.items() if p.exists() and (p.stat().st_ino, p.stat().st_mtime_ns) != ident]
    last = max(finished, key=lambda p: p.parent.name).parent
    record(scenario="SIGTERM during a checkpoint write (training)",
           fault_at=f"training, {len(finished)} checkpoint(s) finished, {len(left)} unfinished one(s) left",
           unit_healthy="not drained in this test (the workflow's SIGTERM and SIGKILL rows drain)", downtime="-",
           foreign_killed=0, recomputed=len(rewritten),
           consistent=f"unfinished checkpoints after the rerun: {len(unfinished())}",
           notes=f"resumed from {last.name}: {yes(f'resuming from {last}' in output)}; losses equal to an "
                 f"uninterrupted run's: {yes(losses(tmp_path / 'out') == reference)}")
    assert f"resuming from {last}" in output
    assert rewritten == [] and unfinished() == [], (rewritten, unfinished())
    assert losses(tmp_path / "out") == reference


def test_resume_is_bitwise_with_an_acceptance_loss(train_inputs, tmp_path):
    """A run with a non-default train.loss (forward KL mixed with lk_hybrid, another
    temperature) resumed from an earlier checkpoint trains exactly what it trained
    uninterrupted, and has its own fingerprint (run directory)."""
    config = {**TRAIN_CONFIG, "epochs": 2, "checkpoint_every": 2, "loss": {"forward_kl": 0.5, "lk_hybrid": 0.5},
              "loss_temperature": 0.7}
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = (train_inputs["train"], None, train_inputs["vocab"], train_inputs["target"], out, cache)
    first = train(*args, config)
    reference = losses(out)
    run_dir = cache / first["fingerprint"]
    steps = sorted(run_dir.glob("step-*"))
    assert len(steps) == 2 and len(reference) == first["steps"] > 2
    # as if killed after the earlier checkpoint: the later one and the finish never happened
    shutil.rmtree(steps[-1])
    (run_dir / "done.json").unlink()
    assert train(*args, config)["fingerprint"] == first["fingerprint"]
    assert losses(out) == reference
    assert train(*args, {**config, "loss": "forward_kl"})["fingerprint"] != first["fingerprint"]


def test_bad_inputs_are_named(train_inputs, tmp_path):
    with pytest.raises(ValueError, match="unknown keys \\['lr_typo'\\]"):
        section_settings("train", {"lr_typo": 1})
    bad = tmp_path / "bad_vocab.safetensors"
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[:10] = True
    save_file({"d2t": torch.zeros(12, dtype=torch.int64), "t2d": t2d}, str(bad))
    with pytest.raises(ValueError, match="bad_vocab.safetensors: d2t and t2d disagree"):
        train(train_inputs["train"], None, bad, train_inputs["target"], tmp_path / "o", tmp_path / "c", TRAIN_CONFIG)


def test_tensorboard_gets_the_training_scalars(train_inputs, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "train"
    train(train_inputs["train"], train_inputs["eval"], train_inputs["vocab"], train_inputs["target"], out,
          tmp_path / "cache", {**TRAIN_CONFIG, "epochs": 2, "report_to": ["tensorboard"]})
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/step_acc/0", "train/step_loss/2", "train/lr", "train/tokens_per_s",
                "train/mfu", "train/data_wait_s", "train/grad_norm", "eval/simulated_acceptance_length/3", "eval/decode_acceptance_length/3"):
        assert tag in tags, (tag, sorted(tags))
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [r["step"] for r in rows]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    with pytest.raises(ValueError, match="report_to"):
        section_settings("train", {"report_to": ["comet"]})
