"""The schema is the one home of the configuration's defaults, and --config values are typed by it."""
from __future__ import annotations

import inspect

import yaml

from eagle3flow import config as config_lib
from eagle3flow.config import coerce_to_schema, schema_defaults


def schema() -> dict:
    return yaml.safe_load(config_lib.SCHEMA.read_text())


def test_every_stage_takes_its_defaults_from_the_schema():
    from eagle3flow.eval.evaluate import EVAL_DEFAULTS, EvalOptions
    from eagle3flow.data.regenerate import DEFAULTS
    from eagle3flow.ops.service import DEFAULTS as DRAIN_DEFAULTS
    from eagle3flow.train.config import TRAIN_DEFAULTS, resolve_train_config

    sections = schema()["properties"]
    for section, used in (("train", TRAIN_DEFAULTS), ("evaluate", EVAL_DEFAULTS), ("regenerate", DEFAULTS),
                          ("drain", DRAIN_DEFAULTS)):
        assert used == {k: v.get("default") for k, v in sections[section]["properties"].items()}, section
    assert resolve_train_config({}) == TRAIN_DEFAULTS
    # evaluate()'s own option defaults are the schema's too (max_tokens drifted to 64 once)
    signature = inspect.signature(EvalOptions).parameters
    for key in ("num_speculative_tokens", "max_tokens", "num_prompts", "agreement_tolerance", "draft_name"):
        assert signature[key].default == EVAL_DEFAULTS[key], key
    assert schema_defaults("train") is not schema_defaults("train"), "callers get their own copy"


def test_command_line_strings_are_typed_as_the_schema_says():
    spec = schema()
    given = {"train": {"epochs": "5", "lr": "0.002", "freeze_lm_head": "true", "nproc": "null",
                       "report_to": ["tensorboard"], "optimizer": "muon", "draft": {"architecture": "mla"}},
             "dataset": {"path": "123", "max_samples": "10"}, "hub": {"dry_run": "True"}}
    typed = coerce_to_schema(given, spec)
    assert typed["train"] == {"epochs": 5, "lr": 0.002, "freeze_lm_head": True, "nproc": None,
                              "report_to": ["tensorboard"], "optimizer": "muon", "draft": {"architecture": "mla"}}
    # a string the schema allows stays a string, even when it reads as a number
    assert typed["dataset"] == {"path": "123", "max_samples": 10} and typed["hub"] == {"dry_run": True}
    assert coerce_to_schema({"train": {"epochs": "five"}}, spec)["train"]["epochs"] == "five", \
        "what does not parse is left for the schema to refuse"
