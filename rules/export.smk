rule export_draft:
    input:
        weights=f"{RESULTS}/train/draft.safetensors",
        draft_config=f"{RESULTS}/train/draft_config.json",
        vocab_map=f"{RESULTS}/vocab/vocab_map.safetensors",
        target=target_input(),
        target_identity=target_identity_input(),
    output:
        DRAFT_FILES,
        EXTRA_DRAFT_FILES,
    params:
        train_dir=lambda wildcards, input: os.path.dirname(input.weights),
        out_dirs=[f"{fmt}={path}" for fmt, path in DRAFT_DIRS.items()],
        k=config["evaluate"]["num_speculative_tokens"],
    log:
        f"{LOGS}/export_draft.log",
    benchmark:
        f"{BENCHMARKS}/export_draft.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.export.checkpoint --train-dir {params.train_dir:q} --vocab-map {input.vocab_map:q}"
        " --target {input.target:q} --out-dir {params.out_dirs:q} --speculative-tokens {params.k} 2>&1 | tee {log:q}"
