rule build_vocab_map:
    input:
        train=LAYOUT.dataset("train.parquet"),
        target=target_input(),
        target_identity=target_identity_input(weights=False),
    output:
        vocab_map=LAYOUT.vocab_map,
        stats=LAYOUT.vocab_stats,
    params:
        cfg=json_arg("vocab"),
    log:
        f"{LOGS}/build_vocab_map.log",
    benchmark:
        f"{BENCHMARKS}/build_vocab_map.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.data.vocab --dataset {input.train:q} --target {input.target:q}"
        " --config-json {params.cfg} --out {output.vocab_map:q} --stats {output.stats:q}"
        " 2>&1 | tee {log:q}"
