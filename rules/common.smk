# What every .smk reads: paths, the resolved config (eagle3flow/config.py), each GPU
# stage's inputs and wrapper, and the helpers the rules share. Only this file defines
# globals that another .smk reads, so the include order cannot change a rule.
import json
import os
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from eagle3flow import config as config_lib
from eagle3flow.layout import Layout
from eagle3flow.layers import normalize_aux_layer_ids as normalize_layer_ids
from eagle3flow.model.config import check_override_keys
from eagle3flow.ops import plan as plan_lib
from eagle3flow.ops.invocation import runs_jobs
from eagle3flow.ops.drain.state import DRAINED_STAGES, ServiceError, run_id_of, unit_state_dir
from eagle3flow.ops.stale_lock import clear_stale_lock, record_owner, snakemake_lock_files
from eagle3flow.target import identity as identity_lib
from eagle3flow.train.launch import DFLASH_TRAINER, trainer_command

# Whether this invocation runs jobs (not a dry run, --lint, --report, ...: those change
# nothing; eagle3flow/ops/invocation.py). Jobs that re-read the workflow never act either.
RUNS_JOBS = workflow.is_main_process and runs_jobs()
# This run's token: onstart puts it in Snakemake's environment, so every job and what it
# starts carries it (eagle3flow/ops/drain/service.py: the drain and the watchdog tell runs apart by it).
RUN_ENV = "EAGLE3FLOW_RUN"
RUN_ID = None
if RUNS_JOBS:
    RUN_ID = run_id_of(os.getpid())
    # A rerun after a kill on this host continues instead of asking for --unlock, when
    # the lock provably belongs to that dead run (see stale_lock.py).
    clear_stale_lock(os.getcwd())


def start_run():
    """onstart (Snakemake holds its locks now): name this run as their owner, and give
    every job this run's token and the regenerate server's URL (config_lib.REGENERATE_URL_ENV)."""
    record_owner(os.getcwd(), snakemake_lock_files(workflow), run_id=RUN_ID,
                 local_exec=not workflow.non_local_exec)
    if RUN_ID:
        os.environ[RUN_ENV] = RUN_ID
    if REGENERATE_URL:
        os.environ[config_lib.REGENERATE_URL_ENV] = REGENERATE_URL

# Every artifact's path (eagle3flow/layout.py); a rule names its own log and benchmark.
LAYOUT = Layout.of(config)
LOGS = LAYOUT.logs
BENCHMARKS = LAYOUT.benchmarks
# The one conda environment the rules name, with .venv's pins (envs/eagle3flow.yaml); .venv is what runs.
CONDA_ENV = "../envs/eagle3flow.yaml"

PRETRAINED_TARGET = LAYOUT.pretrained_target
BUILTIN_PROMPTS = LAYOUT.builtin_prompts
# The target this workflow builds itself (target.path null), or None for a served one.
BUILTIN_TARGET = config_lib.builtin_target(config)
USES_EMBEDDED_TARGET = BUILTIN_TARGET == "embedded"
TARGET = config_lib.target_path(config, {"embedded": LAYOUT.embedded_target,
                                         "smollm2-135m": PRETRAINED_TARGET})
# No dataset: the embedded target's own conversations, else prompts the target answers.
USES_BUILTIN_PROMPTS = config_lib.uses_builtin_prompts(config)
DATASET = config_lib.dataset_path(config, BUILTIN_PROMPTS, LAYOUT.embedded_conversations)
config_lib.check_workflow_config(config)
check_override_keys(config["train"]["draft"])
# The target's own answers (rules/regenerate.smk), which prepare_dataset takes when enabled.
REGENERATED = LAYOUT.regenerated if config["regenerate"]["enabled"] else None
REGENERATE_URL = config_lib.regenerate_url(config)
ORIGINAL_ANSWERS_DIR = LAYOUT.original_answers_dir
config_lib.add_original_answers_draft(config, f"{ORIGINAL_ANSWERS_DIR}/draft")
DRAFT_FILES = [f"{LAYOUT.draft_dir()}/config.json", f"{LAYOUT.draft_dir()}/model.safetensors"]
# export.formats: the first is results/draft/, the others results/draft-<format>/.
DRAFT_DIRS = {fmt: LAYOUT.draft_dir(i, fmt)
              for i, fmt in enumerate(config["export"]["formats"])}
EXTRA_DRAFT_FILES = [f"{path}/{name}" for fmt, path in list(DRAFT_DIRS.items())[1:]
                     for name in ("config.json", "model.safetensors")]
MODEL_CARD = LAYOUT.model_card
GPUS = config["resources"]["gpus"]
# The cores a local job may take (a cluster profile sets no total: --cores).
LOCAL_CORES = workflow.resource_settings.cores or workflow.resource_settings.local_cores or 1
# Threads of a stage that computes (Snakemake exports them as OMP_NUM_THREADS; the stage
# also keeps to its affinity, eagle3flow/device.py limit_cpu_threads): every local core
# where the CPU does the work (no GPUs), one where GPUs do it, so that stages that
# overlap (streaming) are not held back by a count of cores they do not use.
COMPUTE_THREADS = LOCAL_CORES if GPUS == 0 else 1
DRAIN = config["drain"]
# This run's drain records (downtime.json, the drain flags); the unit's session lives in
# the unit's one state folder on the host (eagle3flow/ops/drain/state.py), None while
# drain.unit is unset (the drain job then says what to set).
SERVICE_DIR = LAYOUT.service_dir
try:
    UNIT_STATE_DIR = str(unit_state_dir(DRAIN)) if DRAIN["enabled"] and DRAIN["unit"] else None
except ServiceError as error:
    raise WorkflowError(str(error))
# The checks that need no GPU passed (rules/preflight.smk): `snakemake preflight` writes
# PREFLIGHT_OK; each drain job waits for its own, PREFLIGHT_FOR_DRAIN with its stage and key.
PREFLIGHT_OK = LAYOUT.preflight_ok
PREFLIGHT_FOR_DRAIN = LAYOUT.preflight_for_drain


def normalize_aux_layer_ids():
    """extract.aux_layer_ids as vLLM feeds them to the draft: ascending, each once (with a
    notice when that changed them), and refused here when out of the target's range,
    before any job (so before any model loads). Every stage downstream reads them from
    this config (the extraction, the plan) or from the manifests extraction writes."""
    try:
        num_layers = int(plan_lib.target_config(config, Path(os.getcwd()))[0]["num_hidden_layers"])
    except (OSError, KeyError, ValueError):
        num_layers = None   # a target not on this machine yet: the extraction checks the range
    ids, notice = normalize_layer_ids(config["extract"]["aux_layer_ids"], num_layers)
    if notice and workflow.is_main_process:
        print(f"eagle3flow: {notice}", file=sys.stderr)
    config["extract"]["aux_layer_ids"] = ids


normalize_aux_layer_ids()
# The evaluate section as the evaluation takes it (eagle3flow/config.py evaluate_settings).
EVALUATE = config_lib.evaluate_settings(config, GPUS)

# The plan (rules/plan.smk): the disk budget is checked when the workflow is read (dry
# runs too), without the DAG yet, judged as a whole run from the files that exist;
# projected once (the streaming chain comes from the same plan: rules/streaming_helpers.smk).
PLAN_WHEN_READ, PLAN_REFUSAL = plan_lib.plan_when_read(config, os.getcwd(),
                                                       quiet=not workflow.is_main_process)
if workflow.is_main_process and PLAN_REFUSAL:
    raise WorkflowError(PLAN_REFUSAL)


def gpu_resources(nodes=None):
    """A GPU rule's resources: every GPU of the node for Snakemake's local scheduling
    (``gpus``, which the local profiles cap with --resources), and for a cluster the SLURM
    plugin's ``gpu``/``gpu_model``/``slurm_partition``/--exclusive from the site values
    in ``resources`` (the b200-slurm profile's workflow.yaml). Rules made with ``use
    rule ... as`` inherit them, so every GPU job asks for its GPUs."""
    site = config["resources"]
    out = {"gpus": GPUS}
    if nodes is not None:
        out["nodes"] = nodes
    if site["gpu_partition"] and GPUS > 0:
        out.update(slurm_partition=site["gpu_partition"], gpu=GPUS)
        if site["gpu_model"]:
            out["gpu_model"] = site["gpu_model"]
        if site["gpu_exclusive"]:
            out["slurm_extra"] = "'--exclusive'"
    return out


def target_input():
    """The target as an input: a built-in one is built here; a served one is ancient
    (the directory's own mtime says nothing about its weights): what it holds reaches
    Snakemake through its identity (target_identity_input)."""
    return TARGET if BUILTIN_TARGET else ancient(TARGET)


# A served target's identity (eagle3flow/target/identity.py: per file its size, mtime and
# the full hash of its safetensors header, or of the content of a small file), written
# here when the workflow is read, and only when it changed: its mtime is then the time the
# target was last seen to change, and every stage whose output depends on the target takes
# it as an input. Not a job: Snakemake decides what is out of date before any job runs,
# and reruns every consumer of a job that runs (rules/preflight.smk), so a job taking it
# every run would rerun everything. Stats and headers only: well under a second on a
# 595 GB target. Written by the invocation the user started (dry runs too, so that
# `snakemake -n` shows what a new target reruns), never by a job re-reading the workflow.
# TARGET_CONFIG_IDENTITY: the same less the weight files, for the stages that read no
# weight (the dataset, the vocab map): new weights do not rerun them.
TARGET_IDENTITY = LAYOUT.target_identity
TARGET_CONFIG_IDENTITY = LAYOUT.target_config_identity
HAS_TARGET_IDENTITY = not BUILTIN_TARGET and os.path.isdir(TARGET)
if HAS_TARGET_IDENTITY and workflow.is_main_process:
    identity_lib.write_identity(TARGET, TARGET_IDENTITY, TARGET_CONFIG_IDENTITY)


def target_identity_input(weights=True):
    """The served target's identity file as an input (``weights=False``: the one without
    its weight files); nothing for a built-in target (its directory is a rule's output) or
    one not on this machine (the target input names it)."""
    if not HAS_TARGET_IDENTITY:
        return []
    return TARGET_IDENTITY if weights else TARGET_CONFIG_IDENTITY


def dataset_input():
    """A local dataset is an input file; a hub id is resolved by the stage itself."""
    if config["dataset"]["path"] is None or os.path.exists(DATASET):
        return DATASET
    return []


def optional_flag(flag, value):
    """``flag value`` shell-quoted, or nothing for a path or name that is not set (None,
    '', an absent input): Snakemake's {x:q} leaves '' out, which would hand the flag the
    next argument."""
    return shlex.join([flag, str(value)]) if value else ""


def json_arg_of(value):
    """A config value as one shell-quoted JSON argument."""
    return shlex.quote(json.dumps(value, sort_keys=True))


def json_arg(section):
    return json_arg_of(config[section])


# What each GPU job waits for: its rule's inputs, and its drain job's (rules/drain_helpers.smk).
EXTRACT_INPUTS = dict(
    train=LAYOUT.dataset("train.parquet"),
    eval=LAYOUT.dataset("eval.parquet"),
    target=target_input(),
    target_identity=target_identity_input(),
)
# train.method: dflash trains a DFlash draft (rules/train.smk, rules/export.smk): no vocabulary map.
DFLASH = config["train"]["method"] == "dflash"
TRAIN_INPUTS = dict(
    train=LAYOUT.hidden_states_manifest("train"),
    eval=LAYOUT.hidden_states_manifest("eval"),
    **({} if DFLASH else {"vocab_map": LAYOUT.vocab_map}),
    target=target_input(),
    target_identity=target_identity_input(),
)
# The trainer's checkpoints and --config-json, for train_draft and the streaming links.
TRAIN_CACHE = f"{LAYOUT.train_cache}/dflash" if DFLASH else LAYOUT.train_cache
TRAIN_SETTINGS = (config_lib.dflash_stage_settings(config) if DFLASH
                  else config_lib.train_stage_settings(config))
EVALUATE_INPUTS = dict(
    draft=DRAFT_FILES,
    eval_prompts=LAYOUT.dataset("eval_prompts.jsonl"),
    eval_manifest=LAYOUT.hidden_states_manifest("eval"),
    target=target_input(),
    target_identity=target_identity_input(),
    # Other prompt sets and drafts to compare: rerun when they change.
    prompt_sets=list(EVALUATE["prompt_sets"].values()),
    compare_drafts=[f"{d}/model.safetensors" for d in EVALUATE["compare_drafts"].values()],
)


def drain_flag(stage, key="all"):
    """The input that makes a GPU job wait for the drain; nothing when draining is off.
    One flag per job (``key``: the partition, the streaming link), each made by its own
    drain job after that job's other inputs exist: a drain that has to run for one job
    never makes another job of the stage out of date (a consumed streaming partition
    would be extracted again), and each drain waits for the inputs of its own job."""
    return LAYOUT.drain_flag(stage, key) if DRAIN["enabled"] else []


def drain_flag_of(stage, wildcard):
    """drain_flag for a rule whose jobs are told apart by ``wildcard`` (an input function)."""
    return lambda wildcards: drain_flag(stage, getattr(wildcards, wildcard))


def gpu_stage(stage):
    """The GPU stage wrapper in front of a GPU rule's command (eagle3flow/ops/drain/gpu_stage.py):
    ``{gpu_stage} --log {log} -- <the stage's command>``."""
    command = f"python -m eagle3flow.ops.drain.gpu_stage --stage {stage} --gpus {GPUS}"
    if DRAIN["enabled"]:
        command += " --drain" + (f" --state-dir {shlex.quote(UNIT_STATE_DIR)}" if UNIT_STATE_DIR else "")
    return command


def trainer_launch():
    """The command that starts the trainer, shell-quoted, for train_draft and the streaming
    links: one process per GPU the job holds unless train.nproc forces N, across
    train.nodes nodes (eagle3flow/train/launch.py trainer_command); the DFlash trainer on
    its own section's device."""
    if DFLASH:
        return shlex.join(trainer_command({**config["train"], "device": config["dflash"]["device"]},
                                          "python", DFLASH_TRAINER))
    return shlex.join(trainer_command(config["train"]))


def print_summary(summary_path, draft_dir):
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return
    vllm = summary.get("vllm") or {}
    simulated = summary.get("simulated") or {}
    lossless = summary.get("lossless") or {}
    print("\n=== EAGLE-3 draft ready ===")
    print(f"draft:   {os.path.abspath(draft_dir)}")
    print(f"summary: {os.path.abspath(summary_path)}")
    print(f"vLLM acceptance length:      {vllm.get('acceptance_length')}")
    print(f"simulated acceptance length: {simulated.get('acceptance_length')}")
    print(f"greedy outputs identical:    {lossless.get('passed')}")
