rule build_embedded_target:
    output:
        target=directory(f"{EMBEDDED_DIR}/target"),
        conversations=f"{EMBEDDED_DIR}/conversations.jsonl",
        stats=f"{EMBEDDED_DIR}/build_stats.json",
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.conversations),
        steps=config["embedded"]["train_steps"],
        conversations=config["embedded"]["max_conversations"],
        seed=config["embedded"]["seed"],
    log:
        f"{LOGS}/build_embedded_target.log",
    benchmark:
        f"{BENCHMARKS}/build_embedded_target.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.embedded --out-dir {params.out_dir} --steps {params.steps}"
        " --max-conversations {params.conversations} --seed {params.seed} 2>&1 | tee {log}"
