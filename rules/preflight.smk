# Everything checkable without a GPU, before any drain (eagle3flow/data/preflight.py): the
# config, the target directory (config, whole weights, its own code against
# target.trust_remote_code, aux layer ids, the draft config), the tokenizer and its chat
# template on a row of the dataset. The config-only checks also run when the workflow is
# read (rules/common.smk, the Snakefile), so `snakemake -n` refuses those already.
#
# `snakemake preflight` runs it alone. Every drain_service job waits for a preflight job of
# its own (same stage and key), which runs as soon as the target and the dataset exist, so
# a problem stops the run before production is touched. One per drain job, not one for
# all: Snakemake reruns every consumer of a job that runs, so a preflight shared by the
# drain jobs, run again for one of them (evaluate_draft's, say), would make every drain
# job, and the finished GPU stage behind it, run again (rules/drain_helpers.smk keeps the
# drain jobs apart for the same reason).
#
# The outputs are temp(): every run that drains checks again (the weights may have
# changed since), a run that drains nothing checks nothing.
from eagle3flow.ops.temp_records import drop_stale_records


rule preflight:
    input:
        target=target_input(),
        data=dataset_input(),
    output:
        ok=temp(PREFLIGHT_OK),
    params:
        cfg=json_arg_of(config),
        source=lambda wildcards, input: input.data if input.data else DATASET,
    localrule: True
    log:
        f"{LOGS}/preflight.log",
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.data.preflight --config-json {params.cfg} --target {input.target:q}"
        " --dataset {params.source:q} --out {output.ok:q} 2>&1 | tee {log:q}"


use rule preflight as preflight_before_drain with:
    output:
        ok=temp(PREFLIGHT_FOR_DRAIN),
    wildcard_constraints:
        stage="|".join(DRAINED_STAGES),
        key=r"[A-Za-z0-9]+",
    log:
        f"{LOGS}/preflight_{{stage}}_{{key}}.log",


# After rules/drain_helpers.smk dropped a dead run's flags (included before this file).
# Kept, Snakemake's records of these gone temp files would rerun a preflight or drain job
# whose command changed (a new version, any config edit: the preflight reads the whole
# config), and every finished GPU stage behind it (eagle3flow/ops/temp_records.py).
if workflow.is_main_process:
    drop_stale_records(os.getcwd(), [LAYOUT.preflight_records, LAYOUT.drain_flags])
