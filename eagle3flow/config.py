"""The workflow's configuration: the schema is the one home of every default.

``schemas/config.schema.yaml`` describes every key and holds its default; the stages'
modules read their defaults from it (:func:`schema_defaults`), so a default cannot
differ between the workflow and a stage called by hand.

``snakemake --config key=value`` parses a nested value with YAML's BaseLoader, so every
scalar inside it arrives as a string (``--config "train={epochs: 5}"`` gives
``{"epochs": "5"}``) and the schema would refuse it. :func:`coerce_to_schema` turns such
strings into what the schema says the key holds (integer, number, boolean, null, array,
object) before validation; a string where the schema wants a string stays one.

A stage takes its settings as one ``--config-json '<its config section as JSON>'`` (paths
are flags of their own, and nothing else is): keys of other sections it needs too are
borrowed into that JSON (``trust_remote_code`` from ``target``, for every stage that loads
the target; ``*_BORROWED`` below). :func:`section_settings` is the one resolver every stage
reads it with (:func:`cli_settings` on a command line): the schema's defaults under what
was given, checked against that section of the schema, so a stage called by hand refuses
what the workflow would.

The rest resolves what the validated config leaves open (which target and dataset, the
evaluation's prompt sets and parallelism) and refuses combinations the schema cannot
express: the Snakefile calls these once, so the rules only wire paths to commands.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

import jsonschema
import yaml

# train.loss's losses (eagle3flow/train/objective.py says what each is). Checked here, with the
# config, so that a mix the schema cannot judge is refused when the workflow is read.
LOSSES = ("forward_kl", "tv", "nla", "lk_hybrid")


def loss_mix(value) -> dict[str, float]:
    """``train.loss`` as ``{name: weight}`` (weights > 0, in LOSSES order); ValueError naming the key."""
    if isinstance(value, str):
        value = {value: 1.0}
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"train.loss: {value!r} is neither one of {list(LOSSES)} nor a mapping of them to weights")
    unknown = sorted(set(value) - set(LOSSES))
    if unknown:
        raise ValueError(f"train.loss: unknown losses {unknown} (known: {list(LOSSES)})")
    for name, weight in value.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise ValueError(f"train.loss.{name}: the weight must be a number >= 0, got {weight!r}")
    mix = {name: float(value[name]) for name in LOSSES if value.get(name, 0) > 0}
    if not mix:
        raise ValueError(f"train.loss: every weight is 0 ({dict(value)}): give at least one loss a weight > 0")
    return mix


SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"


def _types(schema: dict) -> list[str]:
    kind = schema.get("type", [])
    return [kind] if isinstance(kind, str) else list(kind)


def coerce_to_schema(value, schema: dict):
    """``value`` with strings the schema does not allow parsed as YAML, recursively."""
    kinds = _types(schema)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return {k: coerce_to_schema(v, properties.get(k) or (extra if isinstance(extra, dict) else {}))
                for k, v in value.items()}
    if isinstance(value, list):
        return [coerce_to_schema(v, schema.get("items") or {}) for v in value]
    if isinstance(value, str) and kinds and "string" not in kinds:
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        # what still is a string is left for the schema's validation to refuse
        return value if isinstance(parsed, str) else coerce_to_schema(parsed, schema)
    return value


def coerce_config(config: dict, schema_path: str) -> None:
    """In place, for the Snakefile: the config as the schema types it."""
    with open(schema_path) as f:
        schema = yaml.safe_load(f)
    config.update(coerce_to_schema(dict(config), schema))


def schema_problems(config: dict, schema: dict | None = None) -> list[str]:
    """Every place ``config`` breaks the schema, one line each, named by its key
    (``evaluate.num_prompts: -5 is less than the minimum of 1``)."""
    # jsonschema comes with Snakemake; imported here so the service environment's
    # modules that only read the config need none of it.
    import jsonschema

    def line(error) -> str:
        # The key's own description says what it takes; its first sentence is enough.
        about = " ".join(str(error.schema.get("description", "")).split()).split(". ")[0].rstrip(".")
        return (f"{'.'.join(map(str, error.absolute_path)) or 'the config'}: {error.message}"
                + (f" ({about})" if about else ""))

    validator = jsonschema.Draft202012Validator(schema or _schema())
    return sorted(line(error) for error in validator.iter_errors(config))


def check_schema(config: dict, schema_path: str) -> None:
    """For the Snakefile, before Snakemake's validate (which names only the first
    problem, by schema path): every problem at once, by key (ValueError)."""
    with open(schema_path) as f:
        problems = schema_problems(config, yaml.safe_load(f))
    if problems:
        raise ValueError(f"the config does not fit {os.path.basename(schema_path)}:\n  " + "\n  ".join(problems))


@functools.cache
def _schema() -> dict:
    with open(SCHEMA) as f:
        return yaml.safe_load(f)


def schema_defaults(section: str) -> dict:
    """``{key: default}`` of one top-level section of the schema (a fresh copy)."""
    properties = _schema()["properties"][section]["properties"]
    return {key: copy.deepcopy(spec.get("default")) for key, spec in properties.items()}


def section_settings(section: str, given: str | Mapping | None = None,
                     borrowed: Mapping[str, str] | None = None) -> dict:
    """A stage's settings: ``given`` (a ``--config-json`` text, or a mapping) over the
    schema's defaults of config section ``section``, checked against that section of the
    schema. ``borrowed``: keys of other sections the stage takes too, ``{its name in the
    settings: "section.key"}`` (the extraction's ``{"max_length": "dataset.max_length"}``),
    defaulted and checked as there.

    Raises ValueError naming every offending key as the config spells it
    (``extract.device: ...``): text that is not a JSON object, a key the stage does not
    take, a value the schema refuses."""
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as error:
            raise ValueError(f"{section}: the settings are not JSON ({error})") from None
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise ValueError(f"{section}: the settings are not a JSON object: {given!r}")
    # each key the stage takes -> where the config has it
    homes = {key: f"{section}.{key}" for key in _schema()["properties"][section]["properties"]}
    clash = sorted(set(homes) & set(borrowed or {}))
    if clash:
        raise ValueError(f"{section}: borrowed keys {clash} are keys of the section itself")
    homes.update(borrowed or {})
    unknown = sorted(set(given) - set(homes))
    if unknown:
        raise ValueError(f"{section}: unknown keys {unknown} (known: {sorted(homes)})")
    properties = {}
    for key, home in homes.items():
        home_section, _, home_key = home.partition(".")
        properties[key] = _schema()["properties"][home_section]["properties"][home_key]
    settings = {key: copy.deepcopy(spec.get("default")) for key, spec in properties.items()}
    settings.update(given)
    validator = jsonschema.Draft202012Validator({"type": "object", "properties": properties})
    errors = sorted(validator.iter_errors(settings), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        raise ValueError("; ".join(".".join([homes[e.absolute_path[0]], *map(str, list(e.absolute_path)[1:])])
                                   + f": {e.message}" for e in errors))
    return settings


# The side-by-side draft regenerate.compare_original_answers adds to evaluate.compare_drafts.
ORIGINAL_ANSWERS_DRAFT = "original answers"


def cli_settings(parser, section: str, given: str, borrowed: Mapping[str, str] | None = None) -> dict:
    """A stage command line's ``--config-json``, resolved by :func:`section_settings`; a bad one
    ends the program with the parser's usage error, naming the key."""
    try:
        return section_settings(section, given, borrowed=borrowed)
    except ValueError as error:
        parser.error(f"--config-json: {error}")

def builtin_target(config: dict) -> str | None:
    """The target this workflow builds itself (``target.path`` null), or None for a served one."""
    return config["target"]["builtin"] if config["target"]["path"] is None else None


def uses_builtin_prompts(config: dict) -> bool:
    """No dataset and no embedded target (whose own conversations are the dataset): the
    workflow writes prompts that the target answers."""
    return config["dataset"]["path"] is None and builtin_target(config) != "embedded"


def target_path(config: dict, builtin_dirs: dict[str, str]) -> str:
    """``target.path``, or the directory a built-in target is built in (``builtin_dirs[name]``)."""
    name = builtin_target(config)
    return config["target"]["path"] if name is None else builtin_dirs[name]


def dataset_path(config: dict, builtin_prompts: str, embedded_conversations: str) -> str:
    """``dataset.path``, else the built-in prompts or the embedded target's conversations."""
    if config["dataset"]["path"] is not None:
        return config["dataset"]["path"]
    return builtin_prompts if uses_builtin_prompts(config) else embedded_conversations


# Where regenerate_responses reads the server's URL: its user:password must reach no
# command line (Snakemake prints, logs and records those), so the workflow hands the
# URL over through the environment.
REGENERATE_URL_ENV = "EAGLE3FLOW_REGENERATE_URL"


def regenerate_url(config: dict, environ=os.environ) -> str | None:
    """The target's server that answers the prompts: regenerate.base_url or
    $EAGLE3FLOW_REGENERATE_URL; None means the job serves a built-in target itself."""
    return config["regenerate"]["base_url"] or environ.get(REGENERATE_URL_ENV)


def redact_url(url: str) -> str:
    """``url`` without user:password, for messages, stats and what the workflow shows."""
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password:
        parts = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))
    return urllib.parse.urlunsplit(parts)


def shown_config(config: dict) -> dict:
    """``config`` as the report shows it: regenerate.base_url without user:password."""
    shown = copy.deepcopy(config)
    if shown["regenerate"]["base_url"]:
        shown["regenerate"]["base_url"] = redact_url(shown["regenerate"]["base_url"])
    return shown


# Keys of other sections a stage takes beside its own (section_settings' ``borrowed``).
# Every stage that loads the target (its tokenizer, transformers, vLLM): whether the
# target's own code may run.
TARGET_BORROWED = {"trust_remote_code": "target.trust_remote_code"}
# prepare_dataset (the target's tokenizer).
DATASET_BORROWED = dict(TARGET_BORROWED)
# The extraction: the dataset's length limit (part of the shards' fingerprint) and the
# node's GPUs (vLLM's tensor parallelism).
EXTRACT_BORROWED = {"max_length": "dataset.max_length", "length_policy": "dataset.length_policy",
                    "gpus": "resources.gpus", "draft_method": "train.method",
                    "dflash_layers": "dflash.num_hidden_layers", **TARGET_BORROWED}
# The regeneration: which rows in which order (the seed prepare_dataset shuffles with,
# beside the section's own seed of the requests) and the chat template's variables; the
# target's code for the server it starts (--serve-target).
REGENERATE_BORROWED = {"format": "dataset.format", "dataset_seed": "dataset.seed",
                       "max_samples": "dataset.max_samples", "chat_template_kwargs": "dataset.chat_template_kwargs",
                       **TARGET_BORROWED}
# The evaluation (the target's tokenizer, vLLM, the replay).
EVALUATE_BORROWED = dict(TARGET_BORROWED)
# The speculators format names the K that `vllm serve <draft>` uses.
EXPORT_BORROWED = {"speculative_tokens": "evaluate.num_speculative_tokens"}
# The model card (it says the run trusted the target's code, and its serving commands do).
MODEL_CARD_BORROWED = dict(TARGET_BORROWED)
# Borrowed keys a workflow command carries only when set (not at the schema's default,
# which the stage takes anyway): keys added to commands that ran without them, so that a
# run at the default keeps its commands as they were (Snakemake reruns a job whose
# params changed).
ONLY_WHEN_SET = frozenset({"target.trust_remote_code", "train.method", "dflash.num_hidden_layers"})


def borrowed_values(config: dict, borrowed: Mapping[str, str]) -> dict:
    """The values of ``borrowed`` keys in the workflow's ``config`` (those of ONLY_WHEN_SET
    only where they differ from the schema's default)."""
    values = {}
    for key, home in borrowed.items():
        section, _, name = home.partition(".")
        value = config[section][name]
        if home not in ONLY_WHEN_SET or value != schema_defaults(section)[name]:
            values[key] = value
    return values


# Train keys added after runs were cached: the trainer's command line and its run's
# fingerprint (eagle3flow/train/checkpoint.py) carry them only when set away from the
# schema's default, so a run at the defaults keeps its job (Snakemake reruns a job whose
# params changed) and resumes its checkpoints.
TRAIN_ONLY_WHEN_SET = ("loss", "loss_temperature", "lk_hybrid_eta", "method")
# Train keys that only pick which checkpoint is kept (not in the fingerprint): off the
# trainer's command line at their defaults too, so a run at the defaults keeps its job.
TRAIN_PICK_ONLY_WHEN_SET = ("checkpoint_metric", "checkpoint_temperature")
# Evaluate keys added after evaluations were made, likewise: the evaluation's command line
# carries them only when set away from the default, so an evaluation at the defaults is
# not made again.
EVALUATE_ONLY_WHEN_SET = ("temperatures", "samples_per_prompt", "sample_seed", "confidence",
                          "lossless_positions", "lossless_false_alarm_rate")


def omit_train_defaults(train: Mapping) -> dict:
    """The train section without the TRAIN_ONLY_WHEN_SET and TRAIN_PICK_ONLY_WHEN_SET keys
    that hold their defaults."""
    defaults = schema_defaults("train")
    return {key: value for key, value in train.items()
            if key not in TRAIN_ONLY_WHEN_SET + TRAIN_PICK_ONLY_WHEN_SET or value != defaults[key]}


def train_stage_settings(config: dict) -> dict:
    """The trainer's --config-json, of train_draft and of every streaming link: the train
    section without the TRAIN_ONLY_WHEN_SET keys at their defaults."""
    return omit_train_defaults(config["train"])


def dataset_stage_settings(config: dict) -> dict:
    """prepare_dataset's --config-json: the dataset section and DATASET_BORROWED."""
    return {**config["dataset"], **borrowed_values(config, DATASET_BORROWED)}


def extract_stage_settings(config: dict) -> dict:
    """The extraction's --config-json: the extract section and EXTRACT_BORROWED."""
    return {**config["extract"], **borrowed_values(config, EXTRACT_BORROWED)}


def regenerate_stage_settings(config: dict) -> dict:
    """regenerate_responses' --config-json: the regenerate section without the workflow's
    switches and without base_url, which the job reads from $EAGLE3FLOW_REGENERATE_URL
    (REGENERATE_URL_ENV), and REGENERATE_BORROWED."""
    settings = {k: v for k, v in config["regenerate"].items() if k not in ("enabled", "compare_original_answers")}
    return {**settings, "base_url": None, **borrowed_values(config, REGENERATE_BORROWED)}


def export_stage_settings(config: dict) -> dict:
    """export_draft's --config-json: the export section and EXPORT_BORROWED."""
    return {**config["export"], **borrowed_values(config, EXPORT_BORROWED)}


# D-PACE's keys, added after DFlash drafts were first trained: they mean something only with
# position_weighting dpace, and only then enter the stage's settings and the run's cache
# key, so a decay run's params and checkpoints stay what they were.
DPACE_KEYS = ("position_weighting", "dpace_alpha")


def without_unused_dpace_keys(dflash: dict) -> dict:
    """The dflash settings less DPACE_KEYS unless position_weighting is dpace (the one rule
    for the train_draft params and eagle3flow/train/dflash_train.py run_fingerprint)."""
    if dflash.get("position_weighting", "decay") == "dpace":
        return dict(dflash)
    return {key: value for key, value in dflash.items() if key not in DPACE_KEYS}


def dflash_stage_settings(config: dict) -> dict:
    """The DFlash trainer's --config-json: the dflash section (less the D-PACE keys unless
    it weighs by D-PACE) and TARGET_BORROWED."""
    return {**without_unused_dpace_keys(config["dflash"]), **borrowed_values(config, TARGET_BORROWED)}


def model_card_settings(config: dict) -> dict:
    """write_model_card's --config-json: of the hub section only what the card shows
    (publishing's dry_run and repo_id must not rewrite it), and MODEL_CARD_BORROWED."""
    return {"base_model": config["hub"]["base_model"], **borrowed_values(config, MODEL_CARD_BORROWED)}


def check_workflow_config(config: dict, environ=os.environ) -> None:
    """Refuse, before any job, the combinations no run can finish (ValueError)."""
    drain = config["drain"]
    if drain["enabled"] and not drain["unit"]:
        # Refused when the workflow is read, not by the drain job: a run that would stop
        # nothing should not first spend its CPU stages (and regenerate) to find out.
        raise ValueError(
            "drain.enabled is true but drain.unit is not set: set drain.unit to the systemd unit "
            "that serves the target (e.g. vllm-kimi-k25-int4.service), or drain.enabled: false "
            "where nothing holds the GPUs")
    # The schema checks each loss name and weight; that some weight is not 0 it cannot say.
    loss_mix(config["train"]["loss"])
    if config["train"]["method"] == "dflash":
        if config["export"]["formats"] != schema_defaults("export")["formats"]:
            raise ValueError("export.formats: a DFlash draft (train.method: dflash) is written in the one "
                             "layout vLLM serves (DFlashDraftModel, results/draft/); leave export.formats "
                             "at its default")
        if config["regenerate"]["compare_original_answers"]:
            raise ValueError("regenerate.compare_original_answers trains an EAGLE-3 draft beside; not with "
                             "train.method: dflash yet")
    regenerate = config["regenerate"]
    if uses_builtin_prompts(config) and not regenerate["enabled"]:
        raise ValueError(
            "dataset.path is null, so the workflow uses its built-in prompts, which have no "
            "answers: set regenerate.enabled: true (the target answers them) or dataset.path")
    if regenerate["enabled"] and not regenerate_url(config, environ) and not builtin_target(config):
        raise ValueError(
            "regenerate.enabled needs the target's server: set regenerate.base_url (or "
            "$EAGLE3FLOW_REGENERATE_URL), and regenerate.model if it serves several models "
            "(the workflow serves the target itself only for a built-in target)")
    if regenerate["compare_original_answers"]:
        if not regenerate["enabled"]:
            raise ValueError("regenerate.compare_original_answers needs regenerate.enabled: true")
        if config["drain"]["enabled"]:
            raise ValueError("regenerate.compare_original_answers trains a second draft in a nested "
                             "run that is not drained for: turn it off where drain.enabled is true")


def add_original_answers_draft(config: dict, draft_dir: str) -> None:
    """In place: with regenerate.compare_original_answers, the evaluation serves the draft
    trained on the dataset's original answers (``draft_dir``) next to the new one."""
    if config["regenerate"]["compare_original_answers"]:
        config["evaluate"]["compare_drafts"].setdefault(ORIGINAL_ANSWERS_DRAFT, draft_dir)


def evaluate_settings(config: dict, gpus: int, exists=os.path.exists) -> dict:
    """The evaluate section as the evaluation takes it: the optional prompt sets that
    exist joined to prompt_sets, tensor parallelism 1 where the node has no GPUs or the
    evaluation runs on the CPU (else, unset, the stage takes every GPU its job sees: the
    node's ``gpus``, or 1 where vLLM turns out to be the CPU build), the replay's
    largest K the TTT steps unless set (the acceptance-length-vs-K curve then comes from
    the one baseline run), the temperatures unless set (:func:`default_temperatures`);
    and EVALUATE_BORROWED; the EVALUATE_ONLY_WHEN_SET keys only away from their defaults."""
    settings = copy.deepcopy(config["evaluate"])
    optional = settings.pop("optional_prompt_sets")
    settings["prompt_sets"] = {**{name: path for name, path in optional.items() if exists(path)},
                               **settings["prompt_sets"]}
    if settings["tensor_parallel_size"] is None and (gpus == 0 or settings["device"] == "cpu"):
        settings["tensor_parallel_size"] = 1
    settings["replay_max_k"] = settings["replay_max_k"] or config["train"]["ttt_steps"]
    if settings["temperatures"] is None:
        settings["temperatures"] = default_temperatures(config)
    defaults = schema_defaults("evaluate")
    settings = {key: value for key, value in settings.items()
                if key not in EVALUATE_ONLY_WHEN_SET or value != defaults[key]}
    settings.update(borrowed_values(config, EVALUATE_BORROWED))
    return settings


def default_temperatures(config: dict) -> list[float] | None:
    """evaluate.temperatures left null: greedy, and the temperature the draft's answers were
    sampled at (regenerate.temperature, where regenerate is on and it is above 0); None
    where that is greedy alone (the stage's default: a run at it keeps its command line)."""
    regenerate = config["regenerate"]
    if regenerate["enabled"] and float(regenerate["temperature"]) > 0:
        return [0.0, float(regenerate["temperature"])]
    return None
