# Shards live in the cache (undeclared, resumable); the manifests written last
# are the declared outputs. Both splits run in one GPU job so the target is
# drained for and loaded once.
EXTRACT_INPUTS = dict(
    train=f"{RESULTS}/dataset/train.parquet",
    eval=f"{RESULTS}/dataset/eval.parquet",
    target=target_input(),
)


rule extract_hidden_states:
    input:
        **EXTRACT_INPUTS,
        drained=drain_flag("extract_hidden_states"),
    output:
        train=f"{RESULTS}/hidden_states/train/manifest.json",
        eval=f"{RESULTS}/hidden_states/eval/manifest.json",
    params:
        cache=f"{CACHE}/hidden_states",
        layers=(
            " --aux-layer-ids " + ",".join(map(str, config["extract"]["aux_layer_ids"]))
            if config["extract"]["aux_layer_ids"]
            else ""
        ),
        cfg=config["extract"],
        gpu_prelude=gpu_stage_prelude("extract_hidden_states", f"{LOGS}/extract_hidden_states.log"),
    resources:
        gpus=GPUS,
    log:
        f"{LOGS}/extract_hidden_states.log",
    benchmark:
        f"{BENCHMARKS}/extract_hidden_states.tsv"
    conda:
        "../envs/train.yaml"
    shell:
        "{params.gpu_prelude}"
        "python -m eagle3flow.hidden_states --target {input.target:q} --cache-root {params.cache}"
        " --split-name train --dataset {input.train} --manifest {output.train}"
        " --split-name eval --dataset {input.eval} --manifest {output.eval}"
        " --dtype {params.cfg[dtype]} --device {params.cfg[device]}"
        " --batch-tokens {params.cfg[batch_tokens]} --shard-tokens {params.cfg[shard_tokens]}"
        "{params.layers} 2>&1 | tee {log}"
