# Helpers of rules/streaming.smk (what the chain is, its files and each link's inputs).
from eagle3flow.ops import streaming as streaming_lib

# The chain (eagle3flow.ops.streaming.Chain) when the budget makes this run stream, else None.
STREAM = plan_lib.streaming_chain(config, os.getcwd(), PLAN_WHEN_READ)
STREAM_DIR = LAYOUT.streaming_dir
STREAM_PART = (
    LAYOUT.streamed_partition_manifest
)
STREAM_LAST = STREAM.links - 1 if STREAM is not None else None
# Links consumed by earlier runs are no jobs of this run (train_partition's wildcard
# constraint leaves them out): their markers are plain source files, so no rerun
# trigger (a changed train param, a new workflow version) can rerun one and with it the
# extraction of its partition, and the inputs that name them stay the same.
STREAM_CONSUMED = (
    streaming_lib.consumed_links(STREAM, STREAM_DIR) if STREAM is not None else set()
)
STREAM_TRAIN_SHELL = (
    "{params.gpu_stage} --log {log:q} --"
    " python -m eagle3flow.ops.streaming train-link {params.link_args}"
    " --train-manifest {input.train:q} --stats {input.stats:q}"
    + (" --method dflash" if DFLASH else " --vocab-map {input.vocab_map:q}") +
    " --target {input.target:q} --cache-root {params.cache:q} --config-json {params.cfg}"
    " --marker {output.consumed:q} -- {params.launch}"
)


def start_streaming():
    """onstart: say how the run streams and pin the chain."""
    if STREAM is not None:
        print(STREAM.describe(), flush=True)
        streaming_lib.write_chain(STREAM, LAYOUT)


def stream_part_pattern(split):
    """A link's part manifest of ``split``, with the {link} and {part} wildcards."""
    return STREAM_PART.format(link="{link}", split=split, part="{part}", partitions=STREAM.partitions)


def stream_manifest(split, link):
    return STREAM_PART.format(link=link, split=split, part=STREAM.partition_of(link),
                              partitions=STREAM.partitions)


def consumed(link):
    return f"{STREAM_DIR}/{streaming_lib.consumed_name(link)}"


def consumed_input(link):
    return [] if link is None else consumed(link)


def extraction_gate(wildcards):
    """Extraction of link j starts once link j-F is consumed (its shards deleted)."""
    return consumed_input(STREAM.waits_for(int(wildcards.link)))


def link_inputs(link):
    inputs = dict(
        train=stream_manifest("train", link),
        **({} if DFLASH else {"vocab_map": LAYOUT.vocab_map}),
        stats=LAYOUT.dataset("stats.json"),
        target=target_input(),
        target_identity=target_identity_input(),
    )
    if link > 0:
        inputs["previous"] = consumed_input(link - 1)
    return inputs


def link_out_dir(link):
    return os.path.dirname(LAYOUT.train("draft.safetensors")) if link == STREAM_LAST else f"{LAYOUT.streaming_cache}/link-{link}"


def link_args(link):
    """train-link options of link ``link``, shell-quoted."""
    args = ["--link", link, "--partitions", STREAM.partitions, "--epochs", STREAM.epochs,
            "--in-flight", STREAM.in_flight, "--out-dir", link_out_dir(link)]
    if link > 0:
        args += ["--previous", consumed(link - 1), "--previous-out-dir", link_out_dir(link - 1)]
    if link == STREAM_LAST:
        args += ["--eval-manifest", LAYOUT.hidden_states_manifest("eval")]
    return shlex.join(map(str, args))


def streaming_drain_inputs(stage, key):
    """The inputs of the streaming GPU job a drain job is for (its flag's key: the link)."""
    if stage == "extract_partition":
        link = int(key)
        return {**EXTRACT_INPUTS, "after": consumed_input(STREAM.waits_for(link))}
    if stage == "train_partition":
        return link_inputs(int(key))
    return {**link_inputs(STREAM_LAST), "eval": LAYOUT.hidden_states_manifest("eval")}
