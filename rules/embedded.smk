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
        "python -m eagle3flow.embedded.build --out-dir {params.out_dir:q} --steps {params.steps}"
        " --max-conversations {params.conversations} --seed {params.seed} 2>&1 | tee {log:q}"


rule build_pretrained_target:
    output:
        target=directory(PRETRAINED_TARGET),
    log:
        f"{LOGS}/build_pretrained_target.log",
    benchmark:
        f"{BENCHMARKS}/build_pretrained_target.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.target.pretrained --out-dir {output.target:q} 2>&1 | tee {log:q}"


rule write_builtin_prompts:
    output:
        prompts=BUILTIN_PROMPTS,
    params:
        num_prompts=config["dataset"]["builtin_prompts"],
    log:
        f"{LOGS}/write_builtin_prompts.log",
    benchmark:
        f"{BENCHMARKS}/write_builtin_prompts.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.data.builtin_prompts --out {output.prompts:q} --count {params.num_prompts} 2>&1 | tee {log:q}"
