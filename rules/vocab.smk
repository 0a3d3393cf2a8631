rule build_vocab_map:
    input:
        train=f"{RESULTS}/dataset/train.parquet",
        target=target_input(),
        target_identity=target_identity_input(weights=False),
    output:
        vocab_map=f"{RESULTS}/vocab/vocab_map.safetensors",
        stats=f"{RESULTS}/vocab/stats.json",
    params:
        size=config["vocab"]["draft_vocab_size"],
    log:
        f"{LOGS}/build_vocab_map.log",
    benchmark:
        f"{BENCHMARKS}/build_vocab_map.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.data.vocab --dataset {input.train:q} --target {input.target:q}"
        " --draft-vocab-size {params.size} --out {output.vocab_map:q} --stats {output.stats:q}"
        " 2>&1 | tee {log:q}"
