import json
import os
from pathlib import Path

from eagle3flow.ops.invocation import runs_jobs
from eagle3flow.ops.stale_lock import clear_stale_lock, record_owner, snakemake_lock_files

# Whether this invocation runs jobs (not a dry run, --lint, --report, ...: those change
# nothing; eagle3flow/ops/invocation.py). Jobs that re-read the workflow never act either.
RUNS_JOBS = workflow.is_main_process and runs_jobs()
# This run's token: onstart puts it in Snakemake's environment, so every job and what it
# starts carries it (eagle3flow/ops/service.py: the drain and the watchdog tell runs apart by it).
RUN_ENV = "EAGLE3FLOW_RUN"
RUN_ID = None
if RUNS_JOBS:
    from eagle3flow.ops.drain_state import run_id_of

    RUN_ID = run_id_of(os.getpid())
    # A rerun after a kill on this host continues instead of asking for --unlock, when
    # the lock provably belongs to that dead run (see stale_lock.py).
    clear_stale_lock(os.getcwd())


def start_run():
    """onstart (Snakemake holds its locks now): name this run as their owner, and give
    every job this run's token."""
    record_owner(os.getcwd(), snakemake_lock_files(workflow), run_id=RUN_ID,
                 local_exec=not workflow.non_local_exec)
    if RUN_ID:
        os.environ[RUN_ENV] = RUN_ID

RESULTS = config["paths"]["results"]
CACHE = config["paths"]["cache"]
LOGS = config["paths"]["logs"]
BENCHMARKS = f"{RESULTS}/benchmarks"

EMBEDDED_DIR = f"{RESULTS}/embedded"
PRETRAINED_TARGET = f"{RESULTS}/pretrained/target"
BUILTIN_PROMPTS = f"{RESULTS}/prompts/builtin_prompts.jsonl"
# The target this workflow builds itself (target.path null), or None for a served one.
BUILTIN_TARGET = config["target"]["builtin"] if config["target"]["path"] is None else None
USES_EMBEDDED_TARGET = BUILTIN_TARGET == "embedded"
TARGET = {None: config["target"]["path"], "embedded": f"{EMBEDDED_DIR}/target",
          "smollm2-135m": PRETRAINED_TARGET}[BUILTIN_TARGET]
# No dataset: the embedded target's own conversations, else prompts the target answers.
USES_BUILTIN_PROMPTS = config["dataset"]["path"] is None and not USES_EMBEDDED_TARGET
DATASET = config["dataset"]["path"] or (
    BUILTIN_PROMPTS if USES_BUILTIN_PROMPTS else f"{EMBEDDED_DIR}/conversations.jsonl"
)
if USES_BUILTIN_PROMPTS and not config["regenerate"]["enabled"]:
    raise ValueError(
        "dataset.path is null, so the workflow uses its built-in prompts, which have no "
        "answers: set regenerate.enabled: true (the target answers them) or dataset.path")
DRAFT_FILES = [f"{RESULTS}/draft/config.json", f"{RESULTS}/draft/model.safetensors"]
# export.formats: the first is results/draft/, the others results/draft-<format>/.
DRAFT_DIRS = {fmt: f"{RESULTS}/draft" + ("" if i == 0 else f"-{fmt}")
              for i, fmt in enumerate(config["export"]["formats"])}
EXTRA_DRAFT_FILES = [f"{path}/{name}" for fmt, path in list(DRAFT_DIRS.items())[1:]
                     for name in ("config.json", "model.safetensors")]
GPUS = config["resources"]["gpus"]


def normalize_aux_layer_ids():
    """extract.aux_layer_ids as vLLM feeds them to the draft: ascending, each once (with a
    notice when that changed them), and refused here when out of the target's range,
    before any job (so before any model loads). Every stage downstream reads them from
    this config (the extraction, the plan) or from the manifests extraction writes."""
    import sys

    from eagle3flow.ops import plan as plan_lib
    from eagle3flow.layers import normalize_aux_layer_ids as normalize

    try:
        num_layers = int(plan_lib.target_config(config, Path(os.getcwd()))[0]["num_hidden_layers"])
    except (OSError, KeyError, ValueError):
        num_layers = None   # a target not on this machine yet: the extraction checks the range
    ids, notice = normalize(config["extract"]["aux_layer_ids"], num_layers)
    if notice and workflow.is_main_process:
        print(f"eagle3flow: {notice}", file=sys.stderr)
    config["extract"]["aux_layer_ids"] = ids


normalize_aux_layer_ids()


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
    if site.get("gpu_partition") and GPUS > 0:
        out.update(slurm_partition=site["gpu_partition"], gpu=GPUS)
        if site.get("gpu_model"):
            out["gpu_model"] = site["gpu_model"]
        if site.get("gpu_exclusive", True):
            out["slurm_extra"] = "'--exclusive'"
    return out


def target_input():
    """The target as an input: a built-in one is built here; a served one is
    ancient, since touching the weights' directory must not re-drain production."""
    return TARGET if BUILTIN_TARGET else ancient(TARGET)


def dataset_input():
    """A local dataset is an input file; a hub id is resolved by the stage itself."""
    if config["dataset"]["path"] is None or os.path.exists(DATASET):
        return DATASET
    return []


def json_arg_of(value):
    """A config value as one shell-quoted JSON argument."""
    import shlex

    return shlex.quote(json.dumps(value, sort_keys=True))


def json_arg(section):
    return json_arg_of(config[section])


def evaluate_config():
    """The evaluate section with tensor parallelism resolved: all GPUs of the node on
    GPUs, 1 on the CPU build."""
    cfg = dict(config["evaluate"])
    optional = cfg.pop("optional_prompt_sets")
    cfg["prompt_sets"] = {**{name: path for name, path in optional.items() if os.path.exists(path)},
                          **cfg["prompt_sets"]}
    if cfg["tensor_parallel_size"] is None:
        cfg["tensor_parallel_size"] = GPUS if GPUS > 0 and cfg["device"] != "cpu" else 1
    return cfg


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
