# The target answers the dataset's prompts itself (eagle3flow/data/regenerate.py), through
# its live OpenAI-compatible server. Everything downstream (prepare_dataset, then the
# GPU stages) takes its output as input, so it runs before any drain_service job,
# while the production server is still up. Answers are cached (undeclared, resumable);
# the declared output is written when every prompt is answered or skipped.
#
# Without a URL (config or $EAGLE3FLOW_REGENERATE_URL) on a built-in target, the job
# serves that target itself with vLLM for its own duration. The URL reaches the job
# through $EAGLE3FLOW_REGENERATE_URL (onstart, rules/common.smk), never its command line:
# a user:password in it would be printed, logged and recorded by Snakemake.
#
# regenerate.compare_original_answers also trains a draft on the dataset's original
# answers (a nested run of this workflow into {RESULTS}/original_answers/) and evaluates
# it side by side with the draft trained on the target's answers (checked, and that
# draft added to evaluate.compare_drafts, in eagle3flow/config.py, from rules/common.smk).
from eagle3flow.data.compare_answers import original_answers_config


rule regenerate_responses:
    input:
        data=dataset_input(),
        target=target_input(),
        target_identity=target_identity_input(),
    output:
        responses=LAYOUT.regenerated,
        stats=LAYOUT.regenerate_stats,
    params:
        source=lambda wildcards, input: input.data if input.data else DATASET,
        out_dir=lambda wildcards, output: os.path.dirname(output.stats),
        cache=LAYOUT.regenerate_cache,
        cfg=json_arg_of(config_lib.regenerate_stage_settings(config)),
        server_log=f"{LOGS}/regenerate_server.log",
        vllm_python=optional_flag("--vllm-python", config["evaluate"]["vllm_python"]),
    log:
        f"{LOGS}/regenerate_responses.log",
    benchmark:
        f"{BENCHMARKS}/regenerate_responses.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.data.regenerate --input {params.source:q} --tokenizer {input.target:q}"
        " --out-dir {params.out_dir:q} --cache-root {params.cache:q} --config-json {params.cfg}"
        " --serve-target {input.target:q} --server-log {params.server_log:q} {params.vllm_python} 2>&1 | tee {log:q}"


rule train_original_answers_draft:
    input:
        data=dataset_input(),
        target=target_input(),
        target_identity=target_identity_input(),
    output:
        f"{ORIGINAL_ANSWERS_DIR}/draft/config.json",
        f"{ORIGINAL_ANSWERS_DIR}/draft/model.safetensors",
    params:
        cfg=json_arg_of(original_answers_config(config)),
        source=lambda wildcards, input: input.data if input.data else DATASET,
        results=lambda wildcards, output: os.path.dirname(os.path.dirname(output[0])),
        cache=LAYOUT.cache,
        logs=f"{LOGS}/original_answers",
        snakefile=workflow.main_snakefile,
    # the nested run gets this job's cores
    threads: LOCAL_CORES
    log:
        f"{LOGS}/train_original_answers_draft.log",
    benchmark:
        f"{BENCHMARKS}/train_original_answers_draft.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.data.compare_answers --snakefile {params.snakefile:q} --config-json {params.cfg}"
        " --target {input.target:q} --dataset {params.source:q} --results {params.results:q}"
        " --cache {params.cache:q} --logs {params.logs:q} --cores {threads} 2>&1 | tee {log:q}"
