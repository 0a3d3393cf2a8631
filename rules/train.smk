# Checkpoints live in the cache (undeclared): a killed run resumes from the last.
rule train_draft:
    input:
        train=f"{RESULTS}/hidden_states/train/manifest.json",
        eval=f"{RESULTS}/hidden_states/eval/manifest.json",
        vocab_map=f"{RESULTS}/vocab/vocab_map.safetensors",
        target=target_input(),
    output:
        weights=f"{RESULTS}/train/draft.safetensors",
        draft_config=f"{RESULTS}/train/draft_config.json",
        metrics=f"{RESULTS}/train/metrics.jsonl",
        eval=f"{RESULTS}/train/eval.json",
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.weights),
        cache=f"{CACHE}/train",
        cfg=json_arg("train"),
    resources:
        gpus=GPUS,
    log:
        f"{LOGS}/train_draft.log",
    benchmark:
        f"{BENCHMARKS}/train_draft.tsv"
    conda:
        "../envs/train.yaml"
    shell:
        "python -m eagle3flow.train --train-manifest {input.train} --eval-manifest {input.eval}"
        " --vocab-map {input.vocab_map} --target {input.target:q} --out-dir {params.out_dir}"
        " --cache-root {params.cache} --config-json {params.cfg} 2>&1 | tee {log}"
