import json
import os

from eagle3flow.stale_lock import clear_stale_lock

# A rerun after a kill continues instead of asking for --unlock (see stale_lock.py).
if workflow.is_main_process:
    clear_stale_lock(os.getcwd())

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
