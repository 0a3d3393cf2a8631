# Figures and tables of the whole run, marked for `snakemake --report report.html`
# (captions in report/). Service downtime is shown when the drain stage left a record.
DOWNTIME = LAYOUT.downtime
REPORT_DIR = LAYOUT.report_dir


rule build_report:
    input:
        eval_summary=LAYOUT.eval_summary,
        metrics=LAYOUT.train("metrics.jsonl"),
        train_eval=LAYOUT.train("eval.json"),
        vocab_stats=LAYOUT.vocab_stats,
        dataset_stats=LAYOUT.dataset("stats.json"),
        manifests=[
            LAYOUT.hidden_states_manifest("train"),
            LAYOUT.hidden_states_manifest("eval"),
        ],
    output:
        training=report(
            f"{REPORT_DIR}/training.png",
            caption="../report/training.rst",
            category="Training",
        ),
        throughput=report(
            f"{REPORT_DIR}/throughput.png",
            caption="../report/throughput.rst",
            category="Training",
        ),
        vocab=report(
            f"{REPORT_DIR}/vocab_coverage.png",
            caption="../report/vocab_coverage.rst",
            category="Training",
        ),
        per_position=report(
            f"{REPORT_DIR}/acceptance_per_position.png",
            caption="../report/acceptance_per_position.rst",
            category="Evaluation",
        ),
        vs_k=report(
            f"{REPORT_DIR}/acceptance_vs_k.png",
            caption="../report/acceptance_vs_k.rst",
            category="Evaluation",
        ),
        tables=report(
            f"{REPORT_DIR}/evaluation.html",
            caption="../report/evaluation.rst",
            category="Evaluation",
        ),
        run=report(
            f"{REPORT_DIR}/run.html",
            caption="../report/run.rst",
            category="Run",
        ),
        summary=report(
            f"{REPORT_DIR}/report.json",
            caption="../report/report_json.rst",
            category="Run",
        ),
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output.training),
        # The drain's record, read when the job runs (the restore after the last GPU
        # stage writes it); without one the report says "no service drained".
        downtime=DOWNTIME,
        cfg=json_arg_of(config_lib.shown_config(config)),
    log:
        f"{LOGS}/build_report.log",
    benchmark:
        f"{BENCHMARKS}/build_report.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.report.render --out-dir {params.out_dir:q}"
        " --eval-summary {input.eval_summary:q} --train-metrics {input.metrics:q}"
        " --train-eval {input.train_eval:q} --vocab-stats {input.vocab_stats:q}"
        " --dataset-stats {input.dataset_stats:q} --manifest {input.manifests:q} --downtime {params.downtime:q}"
        " --config-json {params.cfg} 2>&1 | tee {log:q}"
