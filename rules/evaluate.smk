rule evaluate_draft:
    input:
        draft=DRAFT_FILES,
        eval_prompts=f"{RESULTS}/dataset/eval_prompts.jsonl",
        eval_manifest=f"{RESULTS}/hidden_states/eval/manifest.json",
        target=target_input(),
    output:
        summary=f"{RESULTS}/eval/summary.json",
    params:
        draft_dir=lambda wildcards, input: os.path.dirname(input.draft[0]),
        cfg=json_arg_of(evaluate_config()),
    log:
        f"{LOGS}/evaluate_draft.log",
    benchmark:
        f"{BENCHMARKS}/evaluate_draft.tsv"
    conda:
        "../envs/vllm.yaml"
    shell:
        "python -m eagle3flow.evaluate --draft {params.draft_dir} --target {input.target:q}"
        " --eval-prompts {input.eval_prompts} --eval-manifest {input.eval_manifest}"
        " --out {output.summary} --config-json {params.cfg} 2>&1 | tee {log}"
