"""``python -m eagle3flow.extract``: the extraction rule's command line, for both backends.

Every split is checked and planned (eagle3flow/extract/extraction.py) and the disk checked for
all of them before the target loads; then ``--backend hf`` computes the missing shards in this
process (eagle3flow/extract/hf.py) and ``--backend vllm`` hands the prepared splits to a vLLM
engine (eagle3flow/extract/vllm.py).
"""
from __future__ import annotations

import argparse

import torch

from eagle3flow.config import schema_defaults
from eagle3flow.data.samples import LENGTH_POLICIES
from eagle3flow.device import limit_cpu_threads
from eagle3flow.extract import hf as hf_backend
from eagle3flow.extract import vllm as vllm_backend
from eagle3flow.extract.extraction import check_disk_room, log, prepare

EXTRACT_DEFAULTS = schema_defaults("extract")  # the CLI's defaults are the workflow's


def resolve_backend(device: str) -> str:
    """extract.backend auto: the vLLM engine (tensor parallel over the node) where this job
    sees several CUDA devices, else transformers on the one device (or the CPU)."""
    visible = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    backend = "vllm" if visible > 1 else "hf"
    log(f"backend auto: {backend} ({visible} CUDA device(s) visible)")
    return backend


def parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None or text.strip().lower() in ("", "auto", "none"):
        return None
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    """CLI; every option is an individual flag (no --config-json).

    python -m eagle3flow.extract --dataset results/dataset/train.parquet \\
        --target DIR --manifest results/hidden_states/train/manifest.json \\
        --cache-root cache/hidden_states [--aux-layer-ids 2,4,5] [--dtype auto] \\
        [--storage-dtype auto|fp8] [--device auto] [--batch-tokens N] [--shard-tokens N] \\
        [--max-length N] [--length-policy truncate|drop] [--partition K --partitions N] \\
        [--split-name train] [--trust-remote-code]

    With --partitions N, this job extracts only the K-th of N runs of shards (0-based)
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
    parser.add_argument("--aux-layer-ids", default=None,
                        help="comma-separated; id k = input of decoder layer k (default: [2, N//2, N-3])")
    parser.add_argument("--dtype", default=EXTRACT_DEFAULTS["dtype"], help="auto (float32 on CPU, bfloat16 on CUDA), "
                                                        "float32, bfloat16, float16")
    parser.add_argument("--storage-dtype", default=EXTRACT_DEFAULTS["storage_dtype"],
                        help="auto (= --dtype) or fp8 (float8_e4m3fn, per-token scales: half the disk)")
    parser.add_argument("--device", default=EXTRACT_DEFAULTS["device"], help="auto (cuda if available), cpu, cuda, cuda:N")
    parser.add_argument("--batch-tokens", type=int, default=EXTRACT_DEFAULTS["batch_tokens"], help="padded tokens per forward")
    parser.add_argument("--shard-tokens", type=int, default=EXTRACT_DEFAULTS["shard_tokens"], help="tokens per shard file")
    parser.add_argument("--max-length", type=int, default=None,
                        help="longest sample (the target's context caps it too)")
    parser.add_argument("--length-policy", choices=LENGTH_POLICIES, default="truncate",
                        help="samples over the longest: cut them or leave them out")
    parser.add_argument("--partition", type=int, default=0, help="this job's partition (0-based)")
    parser.add_argument("--partitions", type=int, default=EXTRACT_DEFAULTS["partitions"], help="number of partitions")
    parser.add_argument("--split-name", action="append", default=None)
    parser.add_argument("--backend", choices=("auto", "hf", "vllm"), default=EXTRACT_DEFAULTS["backend"],
                        help="hf: transformers in this process (one device); vllm: a vLLM engine "
                             "(eagle3flow/extract/vllm.py), tensor parallel; auto: vllm when this job "
                             "sees several CUDA devices, else hf")
    parser.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="vllm backend: GPUs the target is split over (default: all visible; 1 on CPU)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="target.trust_remote_code: run the target's own code (auto_map)")
    args = parser.parse_args(argv)
    limit_cpu_threads()
    split_names = args.split_name or ["train"] * len(args.dataset)
    if not len(args.dataset) == len(args.manifest) == len(split_names):
        parser.error("give as many --manifest (and --split-name) as --dataset")
    if args.backend == "auto":
        args.backend = resolve_backend(args.device)
    use_vllm = args.backend == "vllm"
    # Every split is checked and planned, and the disk checked for all of them,
    # before the target loads (minutes for a large one).
    extractions = [
        prepare(dataset, args.target, manifest, args.cache_root,
                aux_layer_ids=parse_layer_ids(args.aux_layer_ids), dtype=args.dtype,
                device=args.device, batch_tokens=args.batch_tokens,
                shard_tokens=args.shard_tokens, max_length=args.max_length,
                length_policy=args.length_policy, storage_dtype=args.storage_dtype,
                split_name=split_name, partition=(args.partition, args.partitions),
                fingerprint_extra=vllm_backend.FINGERPRINT if use_vllm else None,
                trust_remote_code=args.trust_remote_code)
        for dataset, manifest, split_name in zip(args.dataset, args.manifest, split_names)]
    check_disk_room(extractions)
    if use_vllm:
        vllm_backend.run_all(extractions, args.tensor_parallel_size)
        return
    loaded_models: dict = {}
    for x in extractions:
        hf_backend.run(x, loaded_models)


if __name__ == "__main__":
    main()
