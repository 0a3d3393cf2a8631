# vLLM takes every GPU of the node (tensor parallelism), so on a box whose
# production unit holds them the evaluation is drained for like the other GPU stages.
EVALUATE_INPUTS = dict(
    draft=DRAFT_FILES,
    eval_prompts=f"{RESULTS}/dataset/eval_prompts.jsonl",
    eval_manifest=f"{RESULTS}/hidden_states/eval/manifest.json",
    target=target_input(),
    # Other prompt sets and drafts to compare: rerun when they change.
    prompt_sets=list(evaluate_config()["prompt_sets"].values()),
    compare_drafts=[
        f"{d}/model.safetensors" for d in config["evaluate"]["compare_drafts"].values()
    ],
)


rule evaluate_draft:
    input:
        **EVALUATE_INPUTS,
        drained=drain_flag("evaluate_draft", "all"),
    output:
        summary=f"{RESULTS}/eval/summary.json",
    params:
        draft_dir=lambda wildcards, input: os.path.dirname(input.draft[0]),
        # The replay's largest K defaults to the TTT steps: the acceptance-length-vs-K
        # curve then comes from the one baseline run.
        cfg=json_arg_of(
            {
                **evaluate_config(),
                "replay_max_k": config["evaluate"]["replay_max_k"]
                or config["train"]["ttt_steps"],
            }
        ),
        gpu_stage=gpu_stage("evaluate_draft"),
    resources:
        **gpu_resources(),
    log:
        f"{LOGS}/evaluate_draft.log",
    benchmark:
        f"{BENCHMARKS}/evaluate_draft.tsv"
    conda:
        "../envs/vllm.yaml"
    shell:
        "{params.gpu_stage} --log {log} --"
        " python -m eagle3flow.eval.evaluate --draft {params.draft_dir} --target {input.target:q}"
        " --eval-prompts {input.eval_prompts} --eval-manifest {input.eval_manifest}"
        " --out {output.summary} --config-json {params.cfg}"
