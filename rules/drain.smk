# One drain job per GPU job that has to run (rules/drain_helpers.smk says how).
include: "drain_helpers.smk"


rule drain_service:
    input:
        unpack(drained_stage_inputs),
        # Production is stopped only for a run that passed every check needing no GPU.
        preflight=PREFLIGHT_FOR_DRAIN,
    output:
        flag=temp(LAYOUT.drain_flag("{stage}", "{key}")),
    params:
        settings=json_arg("drain"),
        gpus=GPUS,
    wildcard_constraints:
        stage="|".join(DRAINED_STAGES),
        key=r"[A-Za-z0-9]+",
    localrule: True
    log:
        f"{LOGS}/drain_service_{{stage}}_{{key}}.log",
    benchmark:
        f"{BENCHMARKS}/drain_service_{{stage}}_{{key}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.ops.drain.service drain --stage {wildcards.stage} --gpus {params.gpus}"
        " --config-json {params.settings} --flag {output.flag:q}"
        " 2>&1 | tee {log:q}"
