rule prepare_dataset:
    input:
        data=dataset_input(),
        target=target_input(),
        # The target's own answers (rules/regenerate.smk) when regenerate.enabled.
        regenerated=REGENERATED or [],
    output:
        train=f"{RESULTS}/dataset/train.parquet",
        eval=f"{RESULTS}/dataset/eval.parquet",
        eval_prompts=f"{RESULTS}/dataset/eval_prompts.jsonl",
        stats=f"{RESULTS}/dataset/stats.json",
    params:
        source=lambda wildcards, input: input.data if input.data else DATASET,
        out_dir=lambda wildcards, output: os.path.dirname(output.train),
        cfg=config["dataset"],
        template_kwargs=json_arg_of(config["dataset"]["chat_template_kwargs"]),
        regenerated=lambda wildcards, input: (
            f"--regenerated {input.regenerated}" if input.regenerated else ""
        ),
    log:
        f"{LOGS}/prepare_dataset.log",
    benchmark:
        f"{BENCHMARKS}/prepare_dataset.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.data.dataset --input {params.source:q} --tokenizer {input.target:q}"
        " --out-dir {params.out_dir} --format {params.cfg[format]}"
        " --max-length {params.cfg[max_length]} --length-policy {params.cfg[length_policy]}"
        " --eval-fraction {params.cfg[eval_fraction]} --seed {params.cfg[seed]}"
        " --max-bad-fraction {params.cfg[max_bad_fraction]} --num-workers {params.cfg[num_workers]}"
        " --chat-template-kwargs {params.template_kwargs} {params.regenerated}"
        + (" --max-samples {params.cfg[max_samples]}" if config["dataset"]["max_samples"] else "")
        + TRUST_REMOTE_CODE
        + " 2>&1 | tee {log}"
