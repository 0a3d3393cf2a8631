# Checkpoints live in the cache (undeclared): a killed run resumes from the last.
# eagle3flow.train.launch starts one process per GPU the job holds (torchrun; train.nproc
# forces N, e.g. 2 gloo processes on CPU), across train.nodes SLURM nodes (srun).

if DFLASH:

    # A DFlash draft (train.method: dflash, eagle3flow/train/dflash_train.py): the same
    # outputs, from the same hidden states, no vocabulary map; started as the EAGLE-3 trainer.
    rule train_draft:
        input:
            **TRAIN_INPUTS,
            drained=drain_flag("train_draft", "all"),
        output:
            weights=LAYOUT.train("draft.safetensors"),
            draft_config=LAYOUT.train("draft_config.json"),
            metrics=LAYOUT.train("metrics.jsonl"),
            eval=LAYOUT.train("eval.json"),
        params:
            out_dir=lambda wildcards, output: os.path.dirname(output.weights),
            cache=TRAIN_CACHE,
            cfg=json_arg_of(TRAIN_SETTINGS),
            gpu_stage=gpu_stage("train_draft"),
            launch=trainer_launch(),
        threads: COMPUTE_THREADS
        resources:
            **gpu_resources(nodes=config["train"]["nodes"]),
        log:
            f"{LOGS}/train_draft.log",
        benchmark:
            f"{BENCHMARKS}/train_draft.tsv"
        conda:
            CONDA_ENV
        shell:
            "{params.gpu_stage} --log {log:q} -- {params.launch}"
            " --train-manifest {input.train:q} --eval-manifest {input.eval:q} --target {input.target:q}"
            " --out-dir {params.out_dir:q} --cache-root {params.cache:q} --config-json {params.cfg}"

else:

    rule train_draft:
        input:
            **TRAIN_INPUTS,
            drained=drain_flag("train_draft", "all"),
        output:
            weights=LAYOUT.train("draft.safetensors"),
            draft_config=LAYOUT.train("draft_config.json"),
            metrics=LAYOUT.train("metrics.jsonl"),
            eval=LAYOUT.train("eval.json"),
        params:
            out_dir=lambda wildcards, output: os.path.dirname(output.weights),
            cache=TRAIN_CACHE,
            cfg=json_arg_of(TRAIN_SETTINGS),
            gpu_stage=gpu_stage("train_draft"),
            launch=trainer_launch(),
        threads: COMPUTE_THREADS
        resources:
            **gpu_resources(nodes=config["train"]["nodes"]),
        log:
            f"{LOGS}/train_draft.log",
        benchmark:
            f"{BENCHMARKS}/train_draft.tsv"
        conda:
            CONDA_ENV
        shell:
            "{params.gpu_stage} --log {log:q} -- {params.launch}"
            " --train-manifest {input.train:q} --eval-manifest {input.eval:q}"
            " --vocab-map {input.vocab_map:q} --target {input.target:q} --out-dir {params.out_dir:q}"
            " --cache-root {params.cache:q} --config-json {params.cfg}"
