if DFLASH:

    # vLLM's DFlashDraftModel layout (eagle3flow/export/dflash.py), results/draft/ only.
    rule export_draft:
        input:
            weights=LAYOUT.train("draft.safetensors"),
            draft_config=LAYOUT.train("draft_config.json"),
            target=target_input(),
            target_identity=target_identity_input(),
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
            CONDA_ENV
        shell:
            "python -m eagle3flow.export.dflash --train-dir {params.train_dir:q} --target {input.target:q}"
            " --out-dir {params.out_dir:q} 2>&1 | tee {log:q}"

else:

    rule export_draft:
        input:
            weights=LAYOUT.train("draft.safetensors"),
            draft_config=LAYOUT.train("draft_config.json"),
            vocab_map=LAYOUT.vocab_map,
            target=target_input(),
            target_identity=target_identity_input(),
        output:
            DRAFT_FILES,
            EXTRA_DRAFT_FILES,
        params:
            train_dir=lambda wildcards, input: os.path.dirname(input.weights),
            out_dirs=[f"{fmt}={path}" for fmt, path in DRAFT_DIRS.items()],
            cfg=json_arg_of(config_lib.export_stage_settings(config)),
        log:
            f"{LOGS}/export_draft.log",
        benchmark:
            f"{BENCHMARKS}/export_draft.tsv"
        conda:
            CONDA_ENV
        shell:
            "python -m eagle3flow.export.checkpoint --train-dir {params.train_dir:q} --vocab-map {input.vocab_map:q}"
            " --target {input.target:q} --out-dir {params.out_dirs:q} --config-json {params.cfg} 2>&1 | tee {log:q}"
