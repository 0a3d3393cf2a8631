# vLLM takes every GPU of the node (tensor parallelism), so on a box whose
# production unit holds them the evaluation is drained for like the other GPU stages.
# Its inputs (EVALUATE_INPUTS) and settings (EVALUATE) are resolved in rules/common.smk.


rule evaluate_draft:
    input:
        **EVALUATE_INPUTS,
        drained=drain_flag("evaluate_draft", "all"),
    output:
        summary=LAYOUT.eval_summary,
    params:
        draft_dir=lambda wildcards, input: os.path.dirname(input.draft[0]),
        cfg=json_arg_of(EVALUATE),
        gpu_stage=gpu_stage("evaluate_draft"),
    resources:
        **gpu_resources(),
    log:
        f"{LOGS}/evaluate_draft.log",
    benchmark:
        f"{BENCHMARKS}/evaluate_draft.tsv"
    conda:
        CONDA_ENV
    shell:
        "{params.gpu_stage} --log {log:q} --"
        " python -m eagle3flow.eval.evaluate --draft {params.draft_dir:q} --target {input.target:q}"
        " --eval-prompts {input.eval_prompts:q} --eval-manifest {input.eval_manifest:q}"
        " --out {output.summary:q} --config-json {params.cfg}"
