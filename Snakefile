# Trains an EAGLE-3 draft for a model served by vLLM and hands back a draft that
# vLLM and SGLang load as they are. Stages, one .smk each:
#   embedded target (optional) -> prepare_dataset -> extract_hidden_states (GPU)
#   -> build_vocab_map -> train_draft (GPU) -> export_draft -> evaluate_draft
# docs/formats.md describes every artifact.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config.yaml"


# --config "train={epochs: 5}" hands over "5": typed as the schema says, then validated.
from eagle3flow.config import check_schema, coerce_config

coerce_config(config, f"{workflow.basedir}/schemas/config.schema.yaml")
# Every problem at once, named by its key (Snakemake's validate names the first, by schema path).
check_schema(config, f"{workflow.basedir}/schemas/config.schema.yaml")


validate(config, "schemas/config.schema.yaml")


include: "rules/common.smk"
include: "rules/plan.smk"
include: "rules/embedded.smk"
include: "rules/regenerate.smk"
include: "rules/dataset.smk"
include: "rules/hidden_states.smk"
include: "rules/vocab.smk"
include: "rules/train.smk"
include: "rules/streaming.smk"
include: "rules/export.smk"
include: "rules/evaluate.smk"
include: "rules/report.smk"
include: "rules/publish.smk"


report: "report/workflow.rst"
include: "rules/drain.smk"
include: "rules/preflight.smk"


rule all:
    input:
        DRAFT_FILES,
        LAYOUT.eval_summary,
        rules.build_report.output,
        MODEL_CARD,
    default_target: True


onstart:
    start_plan()
    start_streaming()
    # After the disk sampler started: the run's token is for its jobs (rules/common.smk).
    start_run()
    if DRAIN["enabled"]:
        write_drain_plan()


onsuccess:
    restore_service("the workflow finished")
    print_summary(LAYOUT.eval_summary, LAYOUT.draft_dir())
    print_downtime()
    finish_plan()


# Not reached on SIGKILL: the drain's watchdog restores the unit then.
onerror:
    restore_service("the workflow failed")
    print_downtime()
    finish_plan()
