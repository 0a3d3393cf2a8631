rule prepare_dataset:
    input:
        data=dataset_input(),
        target=target_input(),
        target_identity=target_identity_input(weights=False),
        # The target's own answers (rules/regenerate.smk) when regenerate.enabled.
        regenerated=REGENERATED or [],
    output:
        train=LAYOUT.dataset("train.parquet"),
        eval=LAYOUT.dataset("eval.parquet"),
        eval_prompts=LAYOUT.dataset("eval_prompts.jsonl"),
        stats=LAYOUT.dataset("stats.json"),
    params:
        source=lambda wildcards, input: input.data if input.data else DATASET,
        out_dir=lambda wildcards, output: os.path.dirname(output.train),
        cfg=json_arg_of(config_lib.dataset_stage_settings(config)),
        regenerated=lambda wildcards, input: optional_flag("--regenerated", input.regenerated),
    log:
        f"{LOGS}/prepare_dataset.log",
    benchmark:
        f"{BENCHMARKS}/prepare_dataset.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.data.dataset --input {params.source:q} --tokenizer {input.target:q}"
        " --out-dir {params.out_dir:q} {params.regenerated} --config-json {params.cfg} 2>&1 | tee {log:q}"
