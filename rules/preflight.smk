# Everything checkable without a GPU, before any drain (eagle3flow/data/preflight.py): the
# config, the target directory (config, whole weights, its own code against
# target.trust_remote_code, aux layer ids, the draft config), the tokenizer and its chat
# template on a row of the dataset. Every drain_service job takes PREFLIGHT_OK as input
# (rules/drain.smk), so production is never stopped for a run that would fail on these;
# `snakemake preflight` runs it alone. The config-only checks also run when the workflow
# is read (rules/common.smk, the Snakefile), so `snakemake -n` refuses those already.
#
# ok.json is temp(): it lives while its run's drains need it, so every run that drains
# runs the checks again (the weights may have changed since), and a run that drains
# nothing runs none.
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
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.data.preflight --config-json {params.cfg} --target {input.target:q}"
        " --dataset {params.source:q} --out {output.ok} 2>&1 | tee {log}"


# After rules/drain_helpers.smk dropped a dead run's flags (included before this file).
# Without this, a new version of drain_service (this file added its preflight input) or an
# edited drain setting would run every finished GPU stage again (eagle3flow/ops/temp_records.py).
if workflow.is_main_process:
    drop_stale_records(os.getcwd(), [PREFLIGHT_OK, f"{SERVICE_DIR}/drained_for_*.flag"])
