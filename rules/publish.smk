# The model card (eagle3flow/report/model_card.py) beside the exported draft, and, when asked for
# by name (`snakemake --profile P publish_draft`), its upload to the Hugging Face Hub
# (eagle3flow/export/publish.py; the token only from the environment).

rule write_model_card:
    input:
        draft=DRAFT_FILES,
        eval_summary=LAYOUT.eval_summary,
        vocab_stats=LAYOUT.vocab_stats,
        dataset_stats=LAYOUT.dataset("stats.json"),
        train_eval=LAYOUT.train("eval.json"),
        target=target_input(),
        target_identity=target_identity_input(),
    output:
        card=MODEL_CARD,
    params:
        draft_dir=lambda wildcards, input: os.path.dirname(input.draft[0]),
        # only what the card shows: publishing (dry_run, repo_id) must not rewrite it
        cfg=json_arg_of(config_lib.model_card_settings(config)),
    localrule: True
    log:
        f"{LOGS}/write_model_card.log",
    benchmark:
        f"{BENCHMARKS}/write_model_card.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.report.model_card --draft {params.draft_dir:q} --eval-summary {input.eval_summary:q}"
        " --vocab-stats {input.vocab_stats:q} --dataset-stats {input.dataset_stats:q}"
        " --train-eval {input.train_eval:q} --target {input.target:q} --out {output.card:q}"
        " --config-json {params.cfg} 2>&1 | tee {log:q}"


rule publish_draft:
    input:
        draft=DRAFT_FILES,
        card=MODEL_CARD,
    output:
        record=LAYOUT.published,
    params:
        draft_dir=lambda wildcards, input: os.path.dirname(input.card),
        hub=json_arg("hub"),
    localrule: True
    log:
        f"{LOGS}/publish_draft.log",
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.export.publish --draft {params.draft_dir:q} --record {output.record:q}"
        " --config-json {params.hub} 2>&1 | tee {log:q}"
