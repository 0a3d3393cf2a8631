# The model card (eagle3flow/report/model_card.py) beside the exported draft, and, when asked for
# by name (`snakemake --profile P publish_draft`), its upload to the Hugging Face Hub
# (eagle3flow/export/publish.py; the token only from the environment).

rule write_model_card:
    input:
        draft=DRAFT_FILES,
        eval_summary=f"{RESULTS}/eval/summary.json",
        vocab_stats=f"{RESULTS}/vocab/stats.json",
        dataset_stats=f"{RESULTS}/dataset/stats.json",
        train_eval=f"{RESULTS}/train/eval.json",
        target=target_input(),
    output:
        card=MODEL_CARD,
    params:
        draft_dir=lambda wildcards, input: os.path.dirname(input.draft[0]),
        base_model=f"--base-model {config['hub']['base_model']}" if config["hub"]["base_model"] else "",
    localrule: True
    log:
        f"{LOGS}/write_model_card.log",
    benchmark:
        f"{BENCHMARKS}/write_model_card.tsv"
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.report.model_card --draft {params.draft_dir} --eval-summary {input.eval_summary}"
        " --vocab-stats {input.vocab_stats} --dataset-stats {input.dataset_stats}"
        " --train-eval {input.train_eval} --target {input.target:q} {params.base_model}"
        " --out {output.card}"
        + TRUST_REMOTE_CODE
        + " 2>&1 | tee {log}"


rule publish_draft:
    input:
        draft=DRAFT_FILES,
        card=MODEL_CARD,
    output:
        record=f"{RESULTS}/draft/published.json",
    params:
        draft_dir=lambda wildcards, input: os.path.dirname(input.card),
        repo_id=config["hub"]["repo_id"] or "",
        token_env=config["hub"]["token_env"],
        flags=("" if config["hub"]["private"] else " --public") + (" --dry-run" if config["hub"]["dry_run"] else ""),
    localrule: True
    log:
        f"{LOGS}/publish_draft.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m eagle3flow.export.publish --draft {params.draft_dir} --repo-id {params.repo_id:q}"
        " --token-env {params.token_env}{params.flags} --record {output.record} 2>&1 | tee {log}"
