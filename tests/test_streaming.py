"""Streaming partitions (eagle3flow/ops/streaming.py, rules/streaming.smk).

Fast: the partition plan equals extraction's, the chain the budget allows, and a
chained link (real training subprocesses) that starts from the previous link's
checkpoint and consumes its partition.

Slow, one module-scoped pair of Snakemake runs on the embedded default target (built
once per session): an unbudgeted run, then a run whose storage budget is smaller
than the full hidden states, SIGKILLed while training partition 1 and rerun. Its
measured peak disk stays under the budget, no consumed partition is extracted again,
training resumes from its checkpoint, and vLLM's acceptance of its draft is within
noise of the unbudgeted draft's (both served in the one evaluation).
"""
from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3flow.ops import plan as plan_lib
from eagle3flow.ops.plan.sizes import tree_bytes
from eagle3flow.ops import streaming
from eagle3flow.train.config import TRAIN_DEFAULTS
from eagle3flow.train.launch import trainer_command
from support.box import FakeBox
from support.builders import make_hidden_states, make_vocab_map
from support.fault_rows import record, yes
from support.workflow import (embedded_args, embedded_config, file_identity, kill_when, measured_peak, snakemake,
                              start_snakemake)

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- fast

def test_partition_plan_is_extractions(tmp_path):
    """The plan projects partitions from the dataset without torch; they must be the ones
    extraction plans (the same rows cut to max_length, the same shard and partition split)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3flow.extract.shard_plan import plan_partitions, plan_shards

    rng = random.Random(0)
    dataset = tmp_path / "results" / "dataset" / "train.parquet"
    dataset.parent.mkdir(parents=True)
    for _ in range(20):
        lengths = [rng.randint(1, 600) for _ in range(rng.randint(1, 300))]
        shard_tokens, count = rng.choice([256, 1000, 4096]), rng.randint(1, 6)
        max_length = rng.choice([None, 300, 512])
        pq.write_table(pa.table({"num_tokens": lengths}), dataset)
        config = {"paths": {"results": "results"}, "dataset": {"max_length": max_length},
                  "extract": {"shard_tokens": shard_tokens, "partitions": count}}
        kept = [min(n, max_length) if max_length else n for n in lengths]
        expected = [sum(s.num_tokens for s in part) for part in plan_partitions(plan_shards(kept, shard_tokens), count)]
        assert streaming.train_partition_tokens(config, tmp_path, {}) == expected
        assert sum(expected) == sum(kept)


def test_chain_from_budget():
    chain, why = streaming.chain_from_budget(4, 2, room_bytes=250, part_bytes=100)
    assert why is None and (chain.in_flight, chain.links) == (2, 8)
    assert [chain.waits_for(j) for j in range(4)] == [None, None, 0, 1]
    assert [(chain.epoch_of(j), chain.partition_of(j)) for j in (3, 4, 7)] == [(0, 3), (1, 0), (1, 3)]
    assert streaming.chain_from_budget(4, 1, room_bytes=400, part_bytes=100) == (None, None)   # all fit
    chain, why = streaming.chain_from_budget(4, 1, room_bytes=50, part_bytes=100)
    assert chain is None and "not even one of the 4 partitions" in why
    chain, why = streaming.chain_from_budget(1, 1, room_bytes=50, part_bytes=100)
    assert chain is None and "extract.partitions: N" in why


@pytest.fixture(scope="module")
def two_parts(random_llama_target, tmp_path_factory):
    """Two partitions' manifests (hidden states of the random target) and a vocab map."""
    root = tmp_path_factory.mktemp("stream_parts")
    parts = [make_hidden_states(random_llama_target, root / f"part{k}", num_samples=8, seed=k,
                                samples_per_shard=4) for k in range(2)]
    vocab = make_vocab_map(parts[0], 512, 128, root / "vocab_map.safetensors")
    stats = root / "stats.json"
    tokens = sum(json.loads(p.read_text())["num_tokens"] for p in parts)
    stats.write_text(json.dumps({"splits": {"train": {"tokens": tokens}}}))
    return parts, vocab, stats


# Link 0 in its own process, killed right after its consumed marker is on disk, before it
# deletes its partition (SIGKILL, a power loss): the marker's write is held there.
LINK_KILLED_AFTER_ITS_MARKER = """
import json, sys, time
from pathlib import Path
from eagle3flow.ops import streaming
a = json.loads(sys.argv[1])
write_json = streaming.write_json
def marker_then_hold(path, obj, *args, **kwargs):
    write_json(path, obj, *args, **kwargs)
    if Path(path).name.startswith("consumed-"):
        print("marker written", flush=True)
        time.sleep(300)
streaming.write_json = marker_then_hold
streaming.train_link(0, streaming.Chain(**a["chain"]), Path(a["manifest"]), None, None, Path(a["stats"]),
                     Path(a["vocab"]), Path(a["target"]), Path(a["cache"]), Path(a["out"]), a["cfg"],
                     Path(a["marker"]), a["launch"])
"""


def test_link_starts_from_previous_checkpoint_and_consumes_its_partition(two_parts, random_llama_target,
                                                                        tmp_path, capfd):
    """Link 0 is killed between its marker and its deletions: the marker makes it no job
    of any later run, so link 1's job deletes what it left (partition 0's shards), starts
    from link 0's checkpoint and consumes its own partition."""
    parts, vocab, stats = two_parts
    for k, part in enumerate(parts):   # consumed below: work on copies
        shutil.copytree(part.parent, tmp_path / f"part{k}")
        data = json.loads(part.read_text())
        data["shard_dir"] = str(tmp_path / f"part{k}" / "shards")
        (tmp_path / f"part{k}" / "manifest.json").write_text(json.dumps(data))
    manifests = [tmp_path / f"part{k}" / "manifest.json" for k in range(2)]
    chain = streaming.Chain(partitions=2, epochs=1, in_flight=1)
    cfg = {"batch_tokens": 128, "checkpoint_every": 2, "ttt_steps": 2, "lr": 3e-3, "log_every": 1,
           "draft": {"intermediate_size": 64}}
    cache, out = tmp_path / "cache", tmp_path / "out"
    launch = trainer_command({**TRAIN_DEFAULTS, **cfg}, sys.executable)
    markers = [tmp_path / "streaming" / streaming.consumed_name(j) for j in range(2)]
    link0 = subprocess.Popen([sys.executable, "-c", LINK_KILLED_AFTER_ITS_MARKER, json.dumps({
        "chain": {"partitions": 2, "epochs": 1, "in_flight": 1}, "manifest": str(manifests[0]), "stats": str(stats),
        "vocab": str(vocab), "target": str(random_llama_target), "cache": str(cache), "out": str(out / "link-0"),
        "cfg": cfg, "marker": str(markers[0]), "launch": launch})], stdout=subprocess.PIPE, text=True)
    try:
        assert link0.stdout.readline().strip() == "marker written", "link 0 ended before its marker"
    finally:
        link0.kill()
        link0.wait()
    first = json.loads(markers[0].read_text())
    left = [p for p in (tmp_path / "part0" / "shards").iterdir()]
    checkpoint0 = file_identity([Path(first["checkpoint"], "state.pt")])
    assert first["step"] > 2 and checkpoint0 and left, "the crash did not land between marker and deletion"
    capfd.readouterr()

    second = streaming.train_link(1, chain, manifests[1], None, markers[0], stats, vocab, random_llama_target,
                                  cache, out / "final", cfg, markers[1], launch, previous_out_dir=out / "link-0")
    log = capfd.readouterr().err
    still = [p for p in (tmp_path / "part0" / "shards").iterdir()]
    from_link0 = f"train: starting from {first['checkpoint']} (step {first['step']}" in log
    record(scenario="a crash between a streaming link's consumed marker and its deletions",
           fault_at=f"link 0 SIGKILLed after consumed-0.json, {len(left)} file(s) of partition 0 on disk",
           unit_healthy="not drained in this test (streaming with drain, killed mid-chain: its own row)",
           downtime="-", foreign_killed=0,
           recomputed=0 if from_link0 else 1,
           consistent=f"partition 0's files left after link 1's job: {len(still)}",
           notes=f"link 1 started from link 0's checkpoint (step {first['step']}): {yes(from_link0)}; said so: "
                 f"{yes('killed after its marker' in log)}")
    assert still == [], "the killed link's partition leaks: nothing deletes it"
    assert from_link0, log
    assert second["step"] > first["step"] and second["tokens_done"] == stats_tokens(stats)
    # One history of the chain, the LR schedule over all of it (decayed to min_lr_ratio).
    rows = [json.loads(line) for line in (out / "final" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, second["step"] + 1))
    lrs = [r["lr"] for r in rows]
    assert max(lrs) == pytest.approx(3e-3, rel=0.05) and lrs[-1] < 0.5 * 3e-3
    assert lrs[first["step"]] <= lrs[first["step"] - 1], "the schedule goes on, no new warmup"
    assert not Path(first["run_dir"]).exists() and not (out / "link-0").exists(), "previous link pruned"
    assert not list((tmp_path / "part1" / "shards").iterdir()), "consumed shards are deleted"
    assert json.loads(markers[1].read_text())["manifest"]["num_tokens"] == json.loads(
        manifests[1].read_text())["num_tokens"]
    # Killed after training, before the job ended: the rerun trains nothing, needs no shard.
    again = streaming.train_link(1, chain, manifests[1], None, markers[0], stats, vocab, random_llama_target,
                                 cache, out / "final", cfg, markers[1], launch, previous_out_dir=out / "link-0")
    assert again["step"] == second["step"] and "already finished" in capfd.readouterr().err


def stats_tokens(stats: Path) -> int:
    return json.loads(stats.read_text())["splits"]["train"]["tokens"]


def test_dflash_links_train_the_chains_steps_on_one_schedule(two_parts, random_llama_target, tmp_path, capfd):
    """train.method dflash, streamed: link 0 trains its share of dflash.steps by its
    partition's tokens, link 1 starts from link 0's final checkpoint and ends at
    dflash.steps, one cosine schedule over both, though extraction kept fewer tokens than the
    dataset's stats count (cut to the model's length); each link consumes its partition and
    no vocabulary map is read. The last link's job rerun after its consumption (its shards
    and link 0's checkpoint gone) trains and reads nothing."""
    from eagle3flow.train.launch import DFLASH_TRAINER

    parts, _, _ = two_parts
    manifests = []
    for k, part in enumerate(parts):   # consumed below: work on copies
        shutil.copytree(part.parent, tmp_path / f"part{k}")
        data = json.loads(part.read_text())
        data["shard_dir"] = str(tmp_path / f"part{k}" / "shards")
        (tmp_path / f"part{k}" / "manifest.json").write_text(json.dumps(data))
        manifests.append(tmp_path / f"part{k}" / "manifest.json")
    tokens = [json.loads(m.read_text())["num_tokens"] for m in manifests]
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"splits": {"train": {"tokens": sum(tokens) + 40}}}))
    chain = streaming.Chain(partitions=2, epochs=1, in_flight=1)
    steps, lr = 7, 3e-3
    cfg = {"block_size": 3, "steps": steps, "samples_per_step": 2, "anchors_per_sample": 4, "lr": lr,
           "device": "cpu", "mask_token_id": 3}    # the random target has no tokenizer to pick one
    launch = trainer_command({**TRAIN_DEFAULTS, "device": "cpu"}, sys.executable, DFLASH_TRAINER)
    cache, out = tmp_path / "cache", tmp_path / "out"
    markers = [tmp_path / "streaming" / streaming.consumed_name(j) for j in range(2)]
    first = streaming.train_link(0, chain, manifests[0], None, None, stats, None, random_llama_target, cache,
                                 out / "link-0", cfg, markers[0], launch, method="dflash")
    second = streaming.train_link(1, chain, manifests[1], manifests[1], markers[0],
                                  stats, None, random_llama_target, cache, out / "final", cfg, markers[1], launch,
                                  previous_out_dir=out / "link-0", method="dflash")
    log = capfd.readouterr().err
    assert first["step"] == steps * tokens[0] // stats_tokens(stats) and 0 < first["step"] < steps
    assert second["step"] == steps and second["tokens_done"] == sum(tokens) < stats_tokens(stats)
    assert f"starting from {first['checkpoint']} (step {first['step']}" in log, log[-3000:]
    # One history and one schedule: decaying from the peak to 10% of it, on across the links.
    rows = [json.loads(line) for line in (out / "final" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    lrs = [r["lr"] for r in rows]
    assert all(b < a for a, b in zip(lrs, lrs[1:])) and lrs[-1] == pytest.approx(0.1 * lr)
    assert not Path(first["run_dir"]).exists() and not (out / "link-0").exists(), "previous link pruned"
    assert not [f for k in range(2) for f in (tmp_path / f"part{k}" / "shards").iterdir()], \
        "consumed shards are deleted"
    result = json.loads((out / "final" / "eval.json").read_text())
    assert result["method"] == "dflash" and result["loss"] > 0 and result["steps"] == steps
    again = streaming.train_link(1, chain, manifests[1], manifests[1], markers[0], stats, None, random_llama_target,
                                 cache, out / "final", cfg, markers[1], launch, previous_out_dir=out / "link-0",
                                 method="dflash")
    assert again["step"] == steps and "already finished" in capfd.readouterr().err


# ---------------------------------------------------------------- the workflow, streamed

PARTITIONS = 3
SIZES_TTT_STEPS = 7   # train.ttt_steps, the default


@pytest.fixture(scope="module")
def streamed(embedded_workflow, tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    timings = {}

    # 1. Unbudgeted: the session's embedded run (conftest.py embedded_workflow): the full
    #    hidden states, one training run, the exported draft, measured at CI's size.
    full = embedded_workflow["workdir"]
    assert embedded_workflow["result"].returncode == 0, \
        (embedded_workflow["result"].stdout + embedded_workflow["result"].stderr)[-5000:]
    full_peak = embedded_workflow["peak_bytes"]
    train_hidden = tree_bytes(full / "cache" / "hidden_states")

    # 2. The same data under a budget smaller than the full hidden states: 3 partitions,
    #    room for one at a time (two would need a third of the train split more).
    stream = root / "stream"
    shutil.copytree(full, stream, symlinks=True)
    for rel in ("cache", "logs", "results/hidden_states", "results/train", "results/draft", "results/plan",
                "results/benchmarks", "results/eval", "results/report"):
        shutil.rmtree(stream / rel, ignore_errors=True)
    budget = int(full_peak - train_hidden / PARTITIONS)
    config = embedded_config(root / "stream.json", extract={"partitions": PARTITIONS},
                             storage={"max_bytes": budget},
                             evaluate={"compare_drafts": {"unbudgeted": str(full / "results" / "draft")}})
    # The evaluation of both drafts, and the record of what the chain consumed.
    args = ["results/eval/summary.json", "results/hidden_states/train/manifest.json", *embedded_args(config)]

    # 3. Killed while training partition 1, once it has a checkpoint of its own.
    log1 = root / "killed.log"
    t0 = time.monotonic()
    proc = start_snakemake(stream, *args, log=log1, EAGLE3FLOW_TEST_STEP_DELAY="0.5")

    def link1_checkpointed():
        marker = streaming.read_json(stream / "results" / "streaming" / "consumed-0.json")
        if not marker:
            return False
        steps = [int(p.name.split("-")[1]) for p in (stream / "cache" / "train").glob("*/step-*")]
        return any(s > marker["step"] for s in steps)

    kill_when(proc, link1_checkpointed, 900, "a checkpoint of partition 1", log1)
    timings["killed run"] = time.monotonic() - t0
    killed_peak = measured_peak(stream)
    consumed0 = json.loads((stream / "results" / "streaming" / "consumed-0.json").read_text())
    extract0_log = stream / "logs" / "extract_partition_0_0.log"
    extract0_stamp = extract0_log.stat().st_mtime_ns
    resumed_step = max(int(p.name.split("-")[1]) for p in (stream / "cache" / "train").glob("*/step-*"))

    # 4. Rerun to the end (evaluation of both drafts included).
    t0 = time.monotonic()
    rerun = snakemake(stream, *args, timeout=1200)
    timings["rerun"] = time.monotonic() - t0
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-6000:]
    print(f"streaming test timings: {timings}")
    rerun_peak = measured_peak(stream)
    projected = json.loads((stream / "results" / "plan" / "disk_peak.json").read_text())["projected_peak_bytes"]
    return {"full": full, "stream": stream, "budget": budget, "full_peak": full_peak,
            "killed_peak": killed_peak, "rerun_peak": rerun_peak, "projected_peak": projected,
            "train_hidden": train_hidden,
            "consumed0": consumed0, "extract0_log": extract0_log, "extract0_stamp": extract0_stamp,
            "resumed_step": resumed_step, "output": log1.read_text() + rerun.stdout + rerun.stderr,
            "rerun_output": rerun.stdout + rerun.stderr}


@pytest.mark.slow
def test_a_dflash_draft_trains_from_streamed_partitions_under_the_budget(embedded_workflow, tmp_path):
    """train.method dflash under a storage budget smaller than the hidden states: the chain
    an EAGLE-3 draft would get (3 partitions), the DFlash trainer on every link (no
    vocabulary map), the links' steps ending at dflash.steps, the measured peak under the
    budget, the draft exported in vLLM's DFlashDraftModel layout."""
    full = embedded_workflow["workdir"]
    assert embedded_workflow["result"].returncode == 0
    stream = tmp_path / "stream"
    shutil.copytree(full, stream, symlinks=True)
    for rel in ("cache", "logs", "results/hidden_states", "results/train", "results/draft", "results/plan",
                "results/benchmarks", "results/eval", "results/report", "results/vocab"):
        shutil.rmtree(stream / rel, ignore_errors=True)
    layers = json.loads((full / "results" / "eval" / "summary.json").read_text())["settings"]["aux_layer_ids"]
    budget = int(embedded_workflow["peak_bytes"] - tree_bytes(full / "cache" / "hidden_states") / PARTITIONS)
    steps = 60
    config = embedded_config(tmp_path / "dflash.json", train={"method": "dflash"},
                             extract={"partitions": PARTITIONS, "aux_layer_ids": layers},
                             dflash={"block_size": 4, "steps": steps, "samples_per_step": 16},
                             storage={"max_bytes": budget})
    result = snakemake(stream, "results/draft/config.json", "results/hidden_states/train/manifest.json",
                       *embedded_args(config), timeout=1200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert f"streaming: {PARTITIONS} partitions of the train split" in output, output[-4000:]
    markers = [json.loads((stream / "results" / "streaming" / streaming.consumed_name(j)).read_text())
               for j in range(PARTITIONS)]
    link_steps = [m["step"] for m in markers]
    assert link_steps == sorted(set(link_steps)) and link_steps[-1] == steps, link_steps
    assert json.loads((stream / "results" / "train" / "eval.json").read_text())["method"] == "dflash"
    assert not (stream / "results" / "vocab").exists(), "a DFlash draft reads no vocabulary map"
    draft = json.loads((stream / "results" / "draft" / "config.json").read_text())
    assert draft["architectures"] == ["DFlashDraftModel"]
    assert draft["dflash_config"]["target_layer_ids"] == [k - 1 for k in layers]
    assert measured_peak(stream) <= budget


@pytest.mark.slow
def test_budget_smaller_than_hidden_states_streams_under_the_budget(streamed):
    s = streamed
    stream = s["stream"]
    assert s["budget"] < s["full_peak"], "the budget must be smaller than the unbudgeted run's peak"
    assert "streaming: 3 partitions of the train split, at most 1 on disk at a time" in s["output"]
    chain = json.loads((stream / "results" / "streaming" / "chain.json").read_text())
    assert (chain["partitions"], chain["in_flight"]) == (PARTITIONS, 1)
    # Measured (F's sampler, both runs), not projected.
    assert max(s["killed_peak"], s["rerun_peak"]) < s["budget"], (s["killed_peak"], s["rerun_peak"], s["budget"])
    # The plan projects the streamed peak (eval + one partition), not the full one.
    assert abs(s["projected_peak"] - s["rerun_peak"]) <= 0.1 * s["rerun_peak"], (s["projected_peak"], s["rerun_peak"])
    # Every partition consumed, its shards gone; the eval split's kept.
    for link in range(PARTITIONS):
        marker = json.loads((stream / "results" / "streaming" / f"consumed-{link}.json").read_text())
        assert marker["shards"] and not any(
            (Path(marker["shard_dir"]) / e["file"]).exists() for e in marker["shards"]), link
    record = json.loads((stream / "results" / "hidden_states" / "train" / "manifest.json").read_text())
    full_manifest = json.loads((s["full"] / "results" / "hidden_states" / "train" / "manifest.json").read_text())
    assert record["streamed"]["shards_deleted"] and record["num_tokens"] == full_manifest["num_tokens"]
    assert [e["sha256"] for e in record["shards"]] == [e["sha256"] for e in full_manifest["shards"]], \
        "the same shards, bit for bit, as the unbudgeted run's"


@pytest.mark.slow
def test_kill_mid_chain_reextracts_nothing_consumed_and_resumes(streamed):
    s = streamed
    stream = s["stream"]
    assert s["extract0_log"].stat().st_mtime_ns == s["extract0_stamp"], "partition 0 was extracted again"
    # Partitions 0 (consumed) and 1 (in training when killed) were extracted by the first
    # run: the rerun extracts partition 2 only, and trains links 1 (resumed) and 2.
    jobs = plan_lib.parse_job_stats(s["rerun_output"])
    assert (jobs.get("extract_partition"), jobs.get("train_partition"), jobs.get("train_partition_last")) \
        == (1, 1, 1), jobs
    train1 = (stream / "logs" / "train_partition_1.log").read_text()
    assert f"resuming from" in train1 and f"(step {s['resumed_step']}/" in train1, train1[-3000:]
    # No progress lost: the chain ends at the sum of its links' steps.
    eval_json = json.loads((stream / "results" / "train" / "eval.json").read_text())
    markers = [json.loads((stream / "results" / "streaming" / f"consumed-{j}.json").read_text())
               for j in range(PARTITIONS)]
    assert markers[0]["checkpoint"] == s["consumed0"]["checkpoint"], "link 0 was not redone"
    assert eval_json["steps"] == markers[-1]["step"] > markers[1]["step"] > markers[0]["step"]
    rows = [json.loads(line) for line in (stream / "results" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows}), "one history, no step twice"
    # One LR schedule over the chain: after the warmup it only decays, across links too.
    lrs = [r["lr"] for r in rows]
    peak = lrs.index(max(lrs))
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])), lrs


def round_stats(vllm: dict) -> tuple[float, float, int]:
    """Mean and variance of the tokens accepted per speculation round, and the rounds:
    ``acceptance_rate_per_position[j]`` is P(at least j+1 accepted)."""
    tail = vllm["acceptance_rate_per_position"]
    mean = sum(tail)
    second = sum((2 * j + 1) * p for j, p in enumerate(tail))
    return mean, max(0.0, second - mean * mean), int(vllm["num_drafts"])


@pytest.mark.slow
def test_streamed_draft_acceptance_within_noise_of_unbudgeted(streamed):
    summary = json.loads((streamed["stream"] / "results" / "eval" / "summary.json").read_text())
    pairs = summary["results"]["eval"]
    names = list(pairs)
    assert "unbudgeted" in names and len(names) == 2, names
    streamed_al = summary["vllm"]["acceptance_length"]
    unbudgeted_al = pairs["unbudgeted"]["vllm"]["acceptance_length"]
    assert summary["lossless"]["passed"] is True
    # Within noise: three standard errors of the difference of the mean accepted per round
    # (a difference chance alone explains; two would fail identical drafts 1 run in 20).
    (mean_s, var_s, n_s), (mean_u, var_u, n_u) = (round_stats(summary["vllm"]),
                                                  round_stats(pairs["unbudgeted"]["vllm"]))
    assert mean_s == pytest.approx(streamed_al - 1) and mean_u == pytest.approx(unbudgeted_al - 1)
    noise = 3 * math.sqrt(var_s / n_s + var_u / n_u)
    print(f"vLLM acceptance length: streamed {streamed_al:.3f} ({n_s} rounds), unbudgeted "
          f"{unbudgeted_al:.3f} ({n_u} rounds), noise (3 SE) {noise:.3f}")
    assert streamed_al > 1.1 and unbudgeted_al > 1.1, "both drafts speculate"
    assert abs(streamed_al - unbudgeted_al) <= noise, (streamed_al, unbudgeted_al, noise)
    # The same on the whole eval split, replayed without vLLM's sampling of prompts: the
    # simulated acceptance (K = ttt_steps) of both trainings agrees to a fraction of the gain.
    k = str(SIZES_TTT_STEPS)
    sim = [json.loads((streamed[w] / "results" / "train" / "eval.json").read_text())
           ["simulated_acceptance_length"][k] for w in ("stream", "full")]
    print(f"simulated acceptance length (eval split, K={k}): streamed {sim[0]:.3f}, unbudgeted {sim[1]:.3f}")
    assert abs(sim[0] - sim[1]) <= 0.25 * (sim[1] - 1), sim


def test_drain_stays_down_until_the_last_job_of_alternating_stages(tmp_path):
    """On one box the chain alternates extraction and training jobs: the unit comes back
    after the last job of the run, not after each stage's first."""
    box = FakeBox(tmp_path / "box")
    try:
        box.start_unit()
        jobs = ["extract_partition", "train_partition", "extract_partition", "train_partition_last"]
        run_env = box.live_run(jobs)   # the live Snakemake main process and its plan
        for stage in sorted(set(jobs)):
            assert box.service("drain", "--stage", stage, "--gpus", "8", run_env=run_env).returncode == 0
        for stage in jobs:
            ended = subprocess.run(
                [sys.executable, "-m", "eagle3flow.ops.drain.service", "stage-ended", "--state-dir", str(box.state_dir),
                 "--stage", stage, "--exit-code", "0"], env={**box.env, **run_env}, capture_output=True,
                text=True, timeout=60)
            assert ended.returncode == 0, ended.stderr
            if stage != jobs[-1]:
                assert "stays down" in ended.stderr and not box.healthy(), (stage, ended.stderr)
        assert box.healthy()
        assert box.downtime()[-1]["reason"] == "train_partition_last was the last GPU stage of the run"
    finally:
        box.close()
