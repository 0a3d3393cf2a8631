rule build_embedded_target:
    output:
        target=directory(LAYOUT.embedded_target),
        conversations=LAYOUT.embedded_conversations,
        stats=LAYOUT.embedded_stats,
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.conversations),
        cfg=json_arg("embedded"),
    log:
        f"{LOGS}/build_embedded_target.log",
    benchmark:
        f"{BENCHMARKS}/build_embedded_target.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.embedded.build --out-dir {params.out_dir:q} --config-json {params.cfg}"
        " 2>&1 | tee {log:q}"


rule build_pretrained_target:
    output:
        target=directory(PRETRAINED_TARGET),
    log:
        f"{LOGS}/build_pretrained_target.log",
    benchmark:
        f"{BENCHMARKS}/build_pretrained_target.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.target.pretrained --out-dir {output.target:q} 2>&1 | tee {log:q}"


rule write_builtin_prompts:
    output:
        prompts=BUILTIN_PROMPTS,
    params:
        # only the key it takes: another dataset key changing leaves the prompts (and the
        # answers the unit wrote to them) as they are
        cfg=json_arg_of({"builtin_prompts": config["dataset"]["builtin_prompts"]}),
    log:
        f"{LOGS}/write_builtin_prompts.log",
    benchmark:
        f"{BENCHMARKS}/write_builtin_prompts.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.data.builtin_prompts --out {output.prompts:q} --config-json {params.cfg} 2>&1 | tee {log:q}"
