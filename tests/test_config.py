"""The schema is the one home of the configuration's defaults, and --config values are typed by it."""
from __future__ import annotations

import inspect

import pytest
import yaml

from eagle3flow import config as config_lib
from eagle3flow.config import coerce_to_schema, schema_defaults, section_settings


def schema() -> dict:
    return yaml.safe_load(config_lib.SCHEMA.read_text())


def dataclasses_missing():
    import dataclasses

    return dataclasses.MISSING


def test_every_stage_takes_its_defaults_from_the_schema():
    from eagle3flow.eval.evaluate import EVAL_DEFAULTS, EvalOptions
    from eagle3flow.ops.drain.state import DEFAULTS as DRAIN_DEFAULTS
    from eagle3flow.train.config import TRAIN_DEFAULTS

    sections = schema()["properties"]
    for section, used in (("train", TRAIN_DEFAULTS), ("evaluate", EVAL_DEFAULTS), ("drain", DRAIN_DEFAULTS)):
        assert used == {k: v.get("default") for k, v in sections[section]["properties"].items()}, section
    assert section_settings("train", {}) == TRAIN_DEFAULTS
    # evaluate()'s own option defaults are the schema's too (max_tokens drifted to 64 once)
    signature = inspect.signature(EvalOptions).parameters
    for key in ("num_speculative_tokens", "max_tokens", "num_prompts", "agreement_tolerance", "draft_name"):
        assert signature[key].default == EVAL_DEFAULTS[key], key
    assert schema_defaults("train") is not schema_defaults("train"), "callers get their own copy"
    # the dataset stage's (eval_fraction drifted to 0.02 once)
    from dataclasses import fields

    from eagle3flow.data.dataset import DatasetConfig

    dataset = sections["dataset"]["properties"]
    for f in fields(DatasetConfig):
        if f.name in dataset:
            default = f.default_factory() if f.default_factory is not dataclasses_missing() else f.default
            assert default == dataset[f.name].get("default"), f"dataset.{f.name}"


def test_command_line_strings_are_typed_as_the_schema_says():
    spec = schema()
    given = {"train": {"epochs": "5", "lr": "0.002", "nproc": "null",
                       "report_to": ["tensorboard"], "optimizer": "muon", "draft": {"architecture": "mla"}},
             "dataset": {"path": "123", "max_samples": "10"}, "hub": {"dry_run": "True"},
             "evaluate": {"ignore_eos": "true"}}
    typed = coerce_to_schema(given, spec)
    assert typed["evaluate"] == {"ignore_eos": True}
    assert typed["train"] == {"epochs": 5, "lr": 0.002, "nproc": None,
                              "report_to": ["tensorboard"], "optimizer": "muon", "draft": {"architecture": "mla"}}
    # a string the schema allows stays a string, even when it reads as a number
    assert typed["dataset"] == {"path": "123", "max_samples": 10} and typed["hub"] == {"dry_run": True}
    assert coerce_to_schema({"train": {"epochs": "five"}}, spec)["train"]["epochs"] == "five", \
        "what does not parse is left for the schema to refuse"


def workflow_config(**sections) -> dict:
    """The validated config's shape: every section at the schema's defaults, then ``sections``."""
    config = {name: schema_defaults(name) for name in ("target", "dataset", "regenerate", "drain",
                                                       "evaluate", "train", "export", "dflash", "extract",
                                                       "resources")}
    for name, values in sections.items():
        config[name].update(values)
    return config


def test_target_and_dataset_resolve_to_a_built_in_or_the_configured_one():
    builtin_dirs = {"embedded": "r/embedded/target", "smollm2-135m": "r/pretrained/target"}
    embedded = workflow_config(target={"path": None, "builtin": "embedded"})
    assert config_lib.builtin_target(embedded) == "embedded"
    assert config_lib.target_path(embedded, builtin_dirs) == "r/embedded/target"
    assert not config_lib.uses_builtin_prompts(embedded), "the embedded target brings its conversations"
    assert config_lib.dataset_path(embedded, "r/prompts.jsonl", "r/conversations.jsonl") == "r/conversations.jsonl"

    pretrained = workflow_config(target={"path": None, "builtin": "smollm2-135m"})
    assert config_lib.target_path(pretrained, builtin_dirs) == "r/pretrained/target"
    assert config_lib.uses_builtin_prompts(pretrained)
    assert config_lib.dataset_path(pretrained, "r/prompts.jsonl", "r/conversations.jsonl") == "r/prompts.jsonl"

    served = workflow_config(target={"path": "/models/t", "builtin": "embedded"}, dataset={"path": "d.jsonl"})
    assert config_lib.builtin_target(served) is None
    assert config_lib.target_path(served, builtin_dirs) == "/models/t"
    assert config_lib.dataset_path(served, "r/prompts.jsonl", "r/conversations.jsonl") == "d.jsonl"


def test_combinations_no_run_can_finish_are_refused():
    def refusal(environ=None, **sections):
        try:
            config_lib.check_workflow_config(workflow_config(**sections), environ or {})
        except ValueError as error:
            return str(error)
        return None

    pretrained = {"path": None, "builtin": "smollm2-135m"}
    assert "built-in prompts" in refusal(target=pretrained, dataset={"path": None})
    assert refusal(target=pretrained, dataset={"path": None}, regenerate={"enabled": True}) is None
    served = {"path": "/models/t"}
    assert "needs the target's server" in refusal(target=served, regenerate={"enabled": True})
    assert refusal(target=served, regenerate={"enabled": True, "base_url": "http://h:8000/v1"}) is None
    assert refusal({"EAGLE3FLOW_REGENERATE_URL": "http://h:8000/v1"}, target=served,
                   regenerate={"enabled": True}) is None
    assert "needs regenerate.enabled" in refusal(regenerate={"compare_original_answers": True})
    assert "not drained for" in refusal(regenerate={"enabled": True, "compare_original_answers": True},
                                        drain={"enabled": True, "unit": "vllm.service"})
    assert "drain.unit is not set" in refusal(drain={"enabled": True, "unit": None})
    assert refusal(drain={"enabled": False, "unit": None}) is None
    dflash = {"method": "dflash"}
    assert refusal(train=dflash) is None
    assert "export.formats" in refusal(train=dflash, export={"formats": ["eagle3", "speculators"]})
    assert "not with train.method: dflash" in refusal(train=dflash, regenerate={"enabled": True,
                                                                                 "compare_original_answers": True})


def test_train_method_reaches_the_extraction_and_the_dflash_trainer_only_when_set():
    """At the default (eagle3) the extraction's and the trainer's commands are as before
    train.method existed; with dflash the extraction learns whose default layers to take."""
    config = workflow_config()
    assert "draft_method" not in config_lib.extract_stage_settings(config)
    assert "method" not in config_lib.train_stage_settings(config)
    config = workflow_config(train={"method": "dflash"}, dflash={"num_hidden_layers": 3})
    settings = config_lib.extract_stage_settings(config)
    assert settings["draft_method"] == "dflash" and settings["dflash_layers"] == 3
    assert section_settings("extract", settings, borrowed=config_lib.EXTRACT_BORROWED)["draft_method"] == "dflash"
    assert config_lib.dflash_stage_settings(config)["num_hidden_layers"] == 3


def test_regenerate_url_comes_from_the_config_before_the_environment():
    environ = {"EAGLE3FLOW_REGENERATE_URL": "http://env/v1"}
    assert config_lib.regenerate_url(workflow_config(), environ) == "http://env/v1"
    assert config_lib.regenerate_url(workflow_config(regenerate={"base_url": "http://cfg/v1"}), environ) \
        == "http://cfg/v1"
    assert config_lib.regenerate_url(workflow_config(), {}) is None


def test_original_answers_draft_is_compared_only_when_asked_for():
    config = workflow_config()
    config_lib.add_original_answers_draft(config, "r/original_answers/draft")
    assert config["evaluate"]["compare_drafts"] == {}
    config = workflow_config(regenerate={"enabled": True, "compare_original_answers": True},
                             evaluate={"compare_drafts": {"old": "drafts/old"}})
    config_lib.add_original_answers_draft(config, "r/original_answers/draft")
    assert config["evaluate"]["compare_drafts"] == {"old": "drafts/old",
                                                    config_lib.ORIGINAL_ANSWERS_DRAFT: "r/original_answers/draft"}
    # a draft of that name the user configured is kept
    config["evaluate"]["compare_drafts"][config_lib.ORIGINAL_ANSWERS_DRAFT] = "mine"
    config_lib.add_original_answers_draft(config, "r/original_answers/draft")
    assert config["evaluate"]["compare_drafts"][config_lib.ORIGINAL_ANSWERS_DRAFT] == "mine"


def test_evaluate_settings_resolve_prompt_sets_parallelism_and_replay_k():
    config = workflow_config(
        evaluate={"optional_prompt_sets": {"mt_bench": "here.jsonl", "gone": "missing.jsonl"},
                  "prompt_sets": {"mine": "mine.jsonl", "mt_bench": "override.jsonl"}},
        train={"ttt_steps": 5})
    settings = config_lib.evaluate_settings(config, gpus=8, exists=lambda path: path != "missing.jsonl")
    assert "optional_prompt_sets" not in settings
    assert settings["prompt_sets"] == {"mine": "mine.jsonl", "mt_bench": "override.jsonl"}, \
        "an optional set that exists joins, a configured one wins"
    # the stage takes the GPUs its job sees (8 under local-8gpu; 1 where vLLM is the CPU build)
    assert settings["tensor_parallel_size"] is None and settings["replay_max_k"] == 5
    assert "optional_prompt_sets" in config["evaluate"], "the config itself is left as it was"
    assert config_lib.evaluate_settings(config, gpus=0, exists=bool)["tensor_parallel_size"] == 1
    cpu = workflow_config(evaluate={"device": "cpu"})
    assert config_lib.evaluate_settings(cpu, gpus=8)["tensor_parallel_size"] == 1
    pinned = workflow_config(evaluate={"tensor_parallel_size": 2, "replay_max_k": 3})
    settings = config_lib.evaluate_settings(pinned, gpus=8)
    assert (settings["tensor_parallel_size"], settings["replay_max_k"]) == (2, 3)


def test_evaluate_temperatures_default_to_greedy_and_the_regeneration_temperature():
    """evaluate.temperatures null: greedy alone (left null: the stage's command line stays as
    it was) unless the draft's answers were sampled, then that temperature too; a list given
    is kept; a negative temperature is refused naming the key."""
    at_defaults = config_lib.evaluate_settings(workflow_config(), gpus=0)
    assert not set(config_lib.EVALUATE_ONLY_WHEN_SET) & set(at_defaults), \
        "an evaluation at the defaults keeps its command line"
    assert section_settings("evaluate", at_defaults)["temperatures"] is None
    sampled = workflow_config(regenerate={"enabled": True, "temperature": 0.6})
    assert config_lib.evaluate_settings(sampled, gpus=0)["temperatures"] == [0.0, 0.6]
    greedy = workflow_config(regenerate={"enabled": True, "temperature": 0.0})
    assert "temperatures" not in config_lib.evaluate_settings(greedy, gpus=0)
    listed = workflow_config(regenerate={"enabled": True, "temperature": 0.6},
                             evaluate={"temperatures": [0, 1.0]})
    assert config_lib.evaluate_settings(listed, gpus=0)["temperatures"] == [0, 1.0]
    with pytest.raises(ValueError, match="temperatures"):
        section_settings("evaluate", {"temperatures": [-0.5]})
    with pytest.raises(ValueError, match="samples_per_prompt"):
        section_settings("evaluate", {"samples_per_prompt": 1})


def test_config_yaml_holds_only_what_a_user_sets():
    """config.yaml repeats no schema default: a key there either changes its default or is
    a path the user fills in (null until then)."""
    from pathlib import Path

    placeholders = {("target", "path"), ("dataset", "path")}
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text())
    repeated = [f"{section}.{key}" for section, values in config.items() for key, value in values.items()
                if (section, key) not in placeholders and schema_defaults(section).get(key) == value]
    assert not repeated, f"config.yaml repeats the schema's defaults of {repeated}"


def test_train_loss_settings_at_their_defaults_leave_the_trainers_command_and_fingerprint_alone():
    """train.loss, loss_temperature and lk_hybrid_eta came after runs were cached: at their
    defaults neither the trainer's --config-json nor its run's fingerprint names them."""
    from eagle3flow.train.config import NOT_FINGERPRINTED

    config = workflow_config()
    assert config["train"]["loss"] == "forward_kl"
    before = {k: v for k, v in config["train"].items()
              if k not in config_lib.TRAIN_ONLY_WHEN_SET + config_lib.TRAIN_PICK_ONLY_WHEN_SET}
    assert config_lib.train_stage_settings(config) == before
    assert config_lib.omit_train_defaults(section_settings("train", {})) == before
    config["train"].update(loss={"nla": 1}, lk_hybrid_eta=3.0, loss_temperature=0.5)
    assert config_lib.train_stage_settings(config) == {**before, "loss": {"nla": 1}, "loss_temperature": 0.5}
    assert not set(config_lib.TRAIN_ONLY_WHEN_SET) & set(NOT_FINGERPRINTED), "they change the trained weights"
    # The checkpoint pick changes no weight: not fingerprinted, and off the command line at its default.
    assert set(config_lib.TRAIN_PICK_ONLY_WHEN_SET) <= set(NOT_FINGERPRINTED)
    config["train"].update(checkpoint_metric="rejection_estimate")
    assert config_lib.train_stage_settings(config)["checkpoint_metric"] == "rejection_estimate"


def test_a_train_loss_without_any_weight_is_refused_when_the_workflow_is_read():
    config = workflow_config(train={"loss": {"forward_kl": 0, "nla": 0}})
    with pytest.raises(ValueError, match="train.loss: every weight is 0"):
        config_lib.check_workflow_config(config, environ={})
    problems = config_lib.schema_problems({"train": {"loss": {"kl_div": 1}}})
    assert any(p.startswith("train.loss: ") and "kl_div" in p for p in problems), problems
    # --config "train={loss: {nla: 0.5}}" hands over strings: typed as the schema says
    typed = coerce_to_schema({"train": {"loss": {"nla": "0.5"}, "loss_temperature": "0.7"}}, schema())
    assert typed["train"] == {"loss": {"nla": 0.5}, "loss_temperature": 0.7}
    assert coerce_to_schema({"train": {"loss": "lk_hybrid"}}, schema())["train"]["loss"] == "lk_hybrid"


def test_section_settings_fill_defaults_and_refuse_naming_the_key():
    """The one resolver of every stage's --config-json."""
    settings = section_settings("extract", '{"device": "cuda:1", "aux_layer_ids": [2, 5]}')
    assert settings == {**schema_defaults("extract"), "device": "cuda:1", "aux_layer_ids": [2, 5]}
    assert section_settings("extract", None) == section_settings("extract", {}) == schema_defaults("extract")

    def refusal(given, **kwargs) -> str:
        with pytest.raises(ValueError) as error:
            section_settings("extract", given, **kwargs)
        return str(error.value)

    assert "unknown keys ['devise']" in refusal('{"devise": "cpu"}')
    assert "extract.batch_tokens: '64' is not of type 'integer'" in refusal({"batch_tokens": "64"})
    assert "extract.device: 'cuda; touch x' does not match" in refusal({"device": "cuda; touch x"})
    assert "extract.aux_layer_ids.1: -1 is less than the minimum of 0" in refusal({"aux_layer_ids": [2, -1]})
    both = refusal({"dtype": "fp4", "shard_tokens": 0})
    assert "extract.dtype:" in both and "extract.shard_tokens:" in both, "every offending key is named"
    assert "not JSON" in refusal("{device: cpu}") and "not a JSON object" in refusal("[1]")
    # a key of another section the stage takes, defaulted and checked as there
    borrowed = {"max_length": "dataset.max_length", "length_policy": "dataset.length_policy"}
    assert section_settings("extract", {}, borrowed=borrowed)["max_length"] == schema_defaults("dataset")["max_length"]
    assert "dataset.length_policy: 'cut' is not one of" in refusal({"length_policy": "cut"}, borrowed=borrowed)
    assert "unknown keys ['max_length']" in refusal({"max_length": 64})
    assert "dataset.seed: 'x' is not of type 'integer'" in refusal({"order_seed": "x"},
                                                                    borrowed={"order_seed": "dataset.seed"})
    assert "keys of the section itself" in refusal({}, borrowed={"device": "evaluate.device"})


def test_target_trust_remote_code_reaches_every_stage_that_loads_the_target_in_its_settings():
    """target.trust_remote_code is a borrowed key of each such stage's --config-json, built by
    the helper its rule uses and read back by the stage's resolver; off, no command carries
    it (the commands stay what they were: a run made before reruns nothing)."""
    names = ("extract", "hub", "resources")
    stages = {  # section, borrowed keys, the helper its rule builds the JSON with
        "dataset": ("dataset", config_lib.DATASET_BORROWED, config_lib.dataset_stage_settings),
        "extract": ("extract", config_lib.EXTRACT_BORROWED, config_lib.extract_stage_settings),
        "regenerate": ("regenerate", config_lib.REGENERATE_BORROWED, config_lib.regenerate_stage_settings),
        "evaluate": ("evaluate", config_lib.EVALUATE_BORROWED, lambda config: config_lib.evaluate_settings(config, 0)),
        "model_card": ("hub", config_lib.MODEL_CARD_BORROWED, config_lib.model_card_settings),
    }
    for trusted in (False, True):
        config = workflow_config(target={"trust_remote_code": trusted})
        config.update({name: schema_defaults(name) for name in names})
        for stage, (section, borrowed, helper) in stages.items():
            assert borrowed["trust_remote_code"] == "target.trust_remote_code", stage
            given = helper(config)
            assert ("trust_remote_code" in given) is trusted, stage
            assert section_settings(section, given, borrowed=borrowed)["trust_remote_code"] is trusted, stage
    with pytest.raises(ValueError, match="target.trust_remote_code: 'yes' is not of type 'boolean'"):
        section_settings("dataset", {"trust_remote_code": "yes"}, borrowed=config_lib.DATASET_BORROWED)
    with pytest.raises(ValueError, match=r"unknown keys \['trust_remote_code'\]"):
        section_settings("dataset", {"trust_remote_code": True})


def test_the_schema_offers_the_choices_the_code_knows():
    """The stages rely on the schema's enums: they are the code's own lists."""
    from eagle3flow.train.optim import LR_SCHEDULES, OPTIMIZERS
    from eagle3flow.train.trackers import TRACKERS

    sections = schema()["properties"]
    train = sections["train"]["properties"]
    assert train["optimizer"]["enum"] == list(OPTIMIZERS) and train["lr_schedule"]["enum"] == list(LR_SCHEDULES)
    assert train["report_to"]["items"]["enum"] == list(TRACKERS)
