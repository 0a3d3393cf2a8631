# Streaming partitions (eagle3flow/ops/streaming.py, docs/plan.md): when the storage budget
# cannot hold the train split's hidden states, training consumes them partition by
# partition. Link j = partition j % N of epoch j // N:
#   extract_partition j (waits for consumed-(j-F)) -> train_partition j (from link j-1's
#   checkpoint) -> consumed-j.json, link j's shards deleted
# The last link writes results/train/ like train_draft. The eval split is extracted with
# the first epoch's links, merged and kept. F (partitions on disk at once) comes from the
# budget (eagle3flow/ops/plan/); the chain is pinned in results/streaming/chain.json at the
# first run, so a rerun keeps it whatever the budget says then.


include: "streaming_helpers.smk"


if STREAM is not None:

    use rule extract_hidden_states as extract_partition with:
        input:
            **EXTRACT_INPUTS,
            drained=drain_flag_of("extract_partition", "link"),
            after=extraction_gate,
        output:
            train=temp(stream_part_pattern("train")),
            eval=temp(stream_part_pattern("eval")),
        params:
            gpu_stage=gpu_stage("extract_partition"),
        wildcard_constraints:
            link=r"\d+",
            part=r"\d+",
        log:
            f"{LOGS}/extract_partition_{{link}}_{{part}}.log",
        benchmark:
            f"{BENCHMARKS}/extract_partition_{{link}}_{{part}}.tsv"

    # The eval split's partitions are extracted with the first epoch's links and kept.
    rule merge_hidden_states_streamed:
        input:
            eval=[stream_manifest("eval", link) for link in range(STREAM.partitions)],
        output:
            eval=LAYOUT.hidden_states_manifest("eval"),
        localrule: True
        log:
            f"{LOGS}/merge_hidden_states_streamed.log",
        benchmark:
            f"{BENCHMARKS}/merge_hidden_states_streamed.tsv"
        conda:
            CONDA_ENV
        shell:
            "python -m eagle3flow.extract.shards merge --part {input.eval:q} --manifest {output.eval:q} 2>&1 | tee {log:q}"

    # What was extracted and trained on, for the report (the shards are gone).
    rule record_streamed_train_manifest:
        input:
            markers=[consumed(link) for link in range(STREAM.partitions)],
        output:
            train=LAYOUT.hidden_states_manifest("train"),
        localrule: True
        log:
            f"{LOGS}/record_streamed_train_manifest.log",
        benchmark:
            f"{BENCHMARKS}/record_streamed_train_manifest.tsv"
        conda:
            CONDA_ENV
        shell:
            "python -m eagle3flow.ops.streaming record-manifest --marker {input.markers:q} --manifest {output.train:q}"
            " 2>&1 | tee {log:q}"

    rule train_partition:
        input:
            unpack(lambda wildcards: link_inputs(int(wildcards.link))),
            drained=drain_flag_of("train_partition", "link"),
        output:
            consumed=f"{STREAM_DIR}/consumed-{{link}}.json",
        params:
            link_args=lambda wildcards: link_args(int(wildcards.link)),
            cache=TRAIN_CACHE,
            cfg=json_arg_of(TRAIN_SETTINGS),
            launch=trainer_launch(),
            gpu_stage=gpu_stage("train_partition"),
        wildcard_constraints:
            # Links consumed by earlier runs are no jobs of this one (STREAM_CONSUMED).
            link="|".join(str(j) for j in range(STREAM_LAST) if j not in STREAM_CONSUMED) or "none",
        threads: COMPUTE_THREADS
        resources:
            **gpu_resources(nodes=config["train"]["nodes"]),
        log:
            f"{LOGS}/train_partition_{{link}}.log",
        benchmark:
            f"{BENCHMARKS}/train_partition_{{link}}.tsv"
        conda:
            CONDA_ENV
        shell:
            STREAM_TRAIN_SHELL

    # The last link evaluates (best checkpoint, eval.json) and writes train_draft's outputs.
    rule train_partition_last:
        input:
            **link_inputs(STREAM_LAST),
            eval=LAYOUT.hidden_states_manifest("eval"),
            drained=drain_flag("train_partition_last", "last"),
        output:
            weights=LAYOUT.train("draft.safetensors"),
            draft_config=LAYOUT.train("draft_config.json"),
            metrics=LAYOUT.train("metrics.jsonl"),
            eval=LAYOUT.train("eval.json"),
            consumed=f"{STREAM_DIR}/{streaming_lib.consumed_name(STREAM_LAST)}",
        params:
            link_args=link_args(STREAM_LAST),
            cache=TRAIN_CACHE,
            cfg=json_arg_of(TRAIN_SETTINGS),
            launch=trainer_launch(),
            gpu_stage=gpu_stage("train_partition_last"),
        threads: COMPUTE_THREADS
        resources:
            **gpu_resources(nodes=config["train"]["nodes"]),
        log:
            f"{LOGS}/train_partition_{STREAM_LAST}.log",
        benchmark:
            f"{BENCHMARKS}/train_partition_{STREAM_LAST}.tsv"
        conda:
            CONDA_ENV
        shell:
            STREAM_TRAIN_SHELL


    # merge_hidden_states and train_draft need the full hidden states: never while streaming.
    ruleorder: merge_hidden_states_streamed > merge_hidden_states
    ruleorder: record_streamed_train_manifest > merge_hidden_states
    ruleorder: train_partition_last > train_draft
