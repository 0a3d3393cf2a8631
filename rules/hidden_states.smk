# Shards live in the cache (undeclared, resumable); the manifests written last
# are the declared outputs. Both splits run in one GPU job so the target is
# drained for and loaded once. With extract.partitions: N, N such jobs (one per
# node on a cluster, sharing the cache) each extract a run of shards and write
# part-K-of-N.json, a manifest of its own; a local merge job writes manifest.json.
EXTRACT_PARTS = config["extract"]["partitions"]
EXTRACT_PART_MANIFEST = LAYOUT.partition_manifest(EXTRACT_PARTS)


rule extract_hidden_states:
    input:
        **EXTRACT_INPUTS,
        drained=drain_flag_of("extract_hidden_states", "part"),
    output:
        train=EXTRACT_PART_MANIFEST.format(split="train", part="{part}"),
        eval=EXTRACT_PART_MANIFEST.format(split="eval", part="{part}"),
    params:
        cache=LAYOUT.hidden_states_cache,
        cfg=json_arg_of(config_lib.extract_stage_settings(config)),
        gpu_stage=gpu_stage("extract_hidden_states"),
    wildcard_constraints:
        part=r"\d+",
    threads: COMPUTE_THREADS
    resources:
        **gpu_resources(),
    log:
        f"{LOGS}/extract_hidden_states_{{part}}.log",
    benchmark:
        f"{BENCHMARKS}/extract_hidden_states_{{part}}.tsv"
    conda:
        CONDA_ENV
    shell:
        "{params.gpu_stage} --log {log:q} --"
        " python -m eagle3flow.extract --target {input.target:q} --cache-root {params.cache:q}"
        " --partition {wildcards.part}"
        " --split-name train --dataset {input.train:q} --manifest {output.train:q}"
        " --split-name eval --dataset {input.eval:q} --manifest {output.eval:q}"
        " --config-json {params.cfg}"


# Reads N small JSON files: runs where Snakemake runs, never as a cluster job.
rule merge_hidden_states:
    input:
        train=expand(EXTRACT_PART_MANIFEST, split="train", part=range(EXTRACT_PARTS)),
        eval=expand(EXTRACT_PART_MANIFEST, split="eval", part=range(EXTRACT_PARTS)),
    output:
        train=LAYOUT.hidden_states_manifest("train"),
        eval=LAYOUT.hidden_states_manifest("eval"),
    localrule: True
    log:
        f"{LOGS}/merge_hidden_states.log",
    benchmark:
        f"{BENCHMARKS}/merge_hidden_states.tsv"
    conda:
        CONDA_ENV
    shell:
        "python -m eagle3flow.extract.shards merge --part {input.train:q} --manifest {output.train:q}"
        " --part {input.eval:q} --manifest {output.eval:q} 2>&1 | tee {log:q}"
