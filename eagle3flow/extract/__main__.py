"""``python -m eagle3flow.extract``: the extraction rule's command line, for both backends.

Every split is checked and planned (eagle3flow/extract/extraction.py) and the disk checked for
all of them before the target loads; then backend ``hf`` computes the missing shards in this
process (eagle3flow/extract/hf.py) and backend ``vllm`` hands the prepared splits to a vLLM
engine (eagle3flow/extract/vllm.py).
"""
from __future__ import annotations

import argparse

import torch

from eagle3flow.config import EXTRACT_BORROWED, cli_settings
from eagle3flow.device import limit_cpu_threads
from eagle3flow.extract import hf as hf_backend
from eagle3flow.extract import vllm as vllm_backend
from eagle3flow.extract.extraction import check_disk_room, log, prepare


def resolve_backend(device: str) -> str:
    """extract.backend auto: the vLLM engine (tensor parallel over the node) where this job
    sees several CUDA devices, else transformers on the one device (or the CPU)."""
    visible = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    backend = "vllm" if visible > 1 else "hf"
    log(f"backend auto: {backend} ({visible} CUDA device(s) visible)")
    return backend


def main(argv=None) -> None:
    """CLI: artifact paths as flags, the settings as one --config-json.

    python -m eagle3flow.extract --target DIR --cache-root cache/hidden_states \\
        --dataset results/dataset/train.parquet --manifest results/hidden_states/train/manifest.json \\
        [--split-name train] [--partition K] --config-json '{"device": "auto", ...}'

    --config-json is the config's extract section (dtype, storage_dtype, device, backend,
    batch_tokens, shard_tokens, aux_layer_ids, partitions) with the dataset section's
    max_length and length_policy, resources.gpus (vLLM's tensor parallelism; 0 = every
    visible GPU, 1 on the CPU), target.trust_remote_code (trust_remote_code: run the
    target's own code), train.method and dflash.num_hidden_layers (draft_method,
    dflash_layers: whose default layers aux_layer_ids null means); what it leaves out takes
    the schema's default.
    With partitions N, this job extracts only the K-th of N runs of shards (0-based)
    and its manifest lists only those; `python -m eagle3flow.extract.shards merge` joins them.
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.extract",
                                     description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, action="append",
                        help="tokenized dataset parquet (repeat with --manifest and --split-name "
                             "to extract several splits with one loaded target)")
    parser.add_argument("--target", required=True, help="HF target model directory")
    parser.add_argument("--manifest", required=True, action="append", help="manifest.json to write")
    parser.add_argument("--cache-root", required=True, help="shards go to CACHE_ROOT/<fingerprint>/")
    parser.add_argument("--split-name", action="append", default=None)
    parser.add_argument("--partition", type=int, default=0, help="this job's partition (0-based)")
    parser.add_argument("--config-json", default="{}", help="the settings (above)")
    args = parser.parse_args(argv)
    settings = cli_settings(parser, "extract", args.config_json, borrowed=EXTRACT_BORROWED)
    limit_cpu_threads()
    split_names = args.split_name or ["train"] * len(args.dataset)
    if not len(args.dataset) == len(args.manifest) == len(split_names):
        parser.error("give as many --manifest (and --split-name) as --dataset")
    backend = settings["backend"]
    if backend == "auto":
        backend = resolve_backend(settings["device"])
    use_vllm = backend == "vllm"
    # Every split is checked and planned, and the disk checked for all of them,
    # before the target loads (minutes for a large one).
    extractions = [
        prepare(dataset, args.target, manifest, args.cache_root,
                aux_layer_ids=settings["aux_layer_ids"], dtype=settings["dtype"],
                device=settings["device"], batch_tokens=settings["batch_tokens"],
                shard_tokens=settings["shard_tokens"], max_length=settings["max_length"],
                length_policy=settings["length_policy"], storage_dtype=settings["storage_dtype"],
                split_name=split_name, partition=(args.partition, settings["partitions"]),
                fingerprint_extra=vllm_backend.FINGERPRINT if use_vllm else None,
                trust_remote_code=settings["trust_remote_code"],
                draft_method=settings["draft_method"], dflash_layers=settings["dflash_layers"])
        for dataset, manifest, split_name in zip(args.dataset, args.manifest, split_names)]
    check_disk_room(extractions)
    if use_vllm:
        vllm_backend.run_all(extractions, settings["gpus"] or None)
        return
    loaded_models: dict = {}
    for x in extractions:
        hf_backend.run(x, loaded_models)


if __name__ == "__main__":
    main()
