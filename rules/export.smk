rule export_draft:
    input:
        weights=f"{RESULTS}/train/draft.safetensors",
        draft_config=f"{RESULTS}/train/draft_config.json",
        vocab_map=f"{RESULTS}/vocab/vocab_map.safetensors",
        target=target_input(),
    output:
        DRAFT_FILES,
    params:
        train_dir=lambda wildcards, input: os.path.dirname(input.weights),
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/export_draft.log",
    benchmark:
        f"{BENCHMARKS}/export_draft.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.export --train-dir {params.train_dir} --vocab-map {input.vocab_map}"
        " --target {input.target:q} --out-dir {params.out_dir} 2>&1 | tee {log}"
