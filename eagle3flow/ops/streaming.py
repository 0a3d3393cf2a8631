"""Streaming partitions: training consumes the hidden states partition by partition.

When the disk budget (config ``storage``) cannot hold the full hidden states, the
workflow (rules/streaming.smk) chains the ``extract.partitions`` = N partitions of the
train split (eagle3flow/extract/shard_plan.py plans them: runs of consecutive shards of
the train split, which prepare_dataset writes in a seeded random order, so a
partition is a random sample of the topics, not one of them)::

    extract link 0 -> train link 0 -> consumed-0.json (link 0's shards deleted)
    extract link 1 -----------------> train link 1 -> consumed-1.json -> ...

Link j trains partition ``j % N`` in epoch ``j // N`` (several epochs re-extract each
partition: only the deleted shards are recomputed, the cache fingerprint is the
same). Training link j starts from link j-1's final checkpoint (``--init-from``) with
the LR schedule of the whole chain (``--schedule-tokens``): an EAGLE-3 draft's trainer
(eagle3flow/train/trainer.py) passes once over the partition, a DFlash draft's
(eagle3flow/train/dflash_train.py, ``--method dflash``) trains its share of
``dflash.steps`` by the partition's tokens. The
extraction of link j waits for ``consumed-(j-F).json``, F = the partitions the budget
holds at once ("in flight", eagle3flow/ops/plan/ derives it), so it runs ahead of
training by at most F-1 links; on one box extraction and training alternate.

Consuming link j (``python -m eagle3flow.ops.streaming train-link``), idempotent so that a
job killed anywhere in it is simply rerun:

1. train (resumes from the link's own latest checkpoint; returns at once when the
   link's run already finished);
2. write ``consumed-j.json`` once the final checkpoint is on disk (the chain's state:
   Snakemake never asks for a consumed link's extraction again);
3. delete the link's shards, then the previous link's run directory (its final
   checkpoint is no longer needed: this link's is). A job killed between 2 and 3 is
   never rerun (its marker is on disk, so the link is no job of any later run): the
   next link's job deletes what it left first (:func:`finish_consuming`, idempotent),
   before the next extraction of that partition can start (it waits for a later
   link's marker).

Everything here but :func:`train_link` is cheap (no torch): the plan and the
Snakefile call it when the workflow is read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.config import TARGET_BORROWED, cli_settings, omit_train_defaults
from eagle3flow.layout import Layout
from eagle3flow.extract.manifest_totals import SUMMED_KEYS
from eagle3flow.extract.shard_plan import plan_partitions, plan_shards
from eagle3flow.extract.throughput import THROUGHPUT_FILE, merge_throughput_logs, throughput_path



def consumed_name(link: int) -> str:
    return f"consumed-{link}.json"


@dataclass(frozen=True)
class Chain:
    """The streaming chain the budget allows: ``partitions`` x ``epochs`` links, at most
    ``in_flight`` partitions' shards on disk at once."""
    partitions: int
    epochs: int
    in_flight: int
    part_bytes: int = 0         # projected bytes of the largest partition's shards

    @property
    def links(self) -> int:
        return self.partitions * self.epochs

    def partition_of(self, link: int) -> int:
        return link % self.partitions

    def epoch_of(self, link: int) -> int:
        return link // self.partitions

    def waits_for(self, link: int) -> int | None:
        """The link whose consumption lets link ``link``'s extraction start (None: none)."""
        return link - self.in_flight if link >= self.in_flight else None

    def to_json(self) -> dict:
        return {**asdict(self), "links": self.links}

    def describe(self) -> str:
        epochs = (f", {self.epochs} epochs: every partition re-extracted each epoch "
                  "(the shards of all partitions do not fit)" if self.epochs > 1 else "")
        ahead = ("extraction and training alternate" if self.in_flight == 1 else
                 f"extraction runs up to {self.in_flight - 1} ahead of training")
        return (f"streaming: {self.partitions} partitions of the train split, at most "
                f"{self.in_flight} on disk at a time ({ahead}), {self.links} chained training "
                f"links{epochs}")


# ----------------------------------------------------------------------------- partitions

def train_partition_tokens(config: dict, root: Path, target: dict) -> list[int] | None:
    """Exact tokens of each train partition from ``results/dataset/train.parquet`` (its
    ``num_tokens`` column, cut to max_length and the target's context), or None before
    the dataset exists."""
    path = root / Layout.of(config).dataset("train.parquet")
    if not path.is_file():
        return None
    import pyarrow.parquet as pq  # light next to torch; only once the dataset exists

    lengths = pq.read_table(str(path), columns=["num_tokens"]).column("num_tokens").to_pylist()
    limits = [x for x in (config["dataset"].get("max_length"), target.get("max_position_embeddings")) if x]
    limit = min(limits) if limits else None
    drop = config["dataset"].get("length_policy") == "drop"
    if limit:
        lengths = [0 if (drop and n > limit) else min(n, limit) for n in lengths]
    shards = plan_shards(lengths, int(config["extract"]["shard_tokens"]))
    if not shards:
        return None
    return [sum(s.num_tokens for s in part) for part in plan_partitions(shards, int(config["extract"]["partitions"]))]


# ----------------------------------------------------------------------------- chain state

def read_json(path: Path) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def chain_epochs(config: dict) -> int:
    """The passes a chain makes over the train split: ``train.epochs`` for an EAGLE-3 draft;
    one for a DFlash draft, which trains ``dflash.steps`` whatever the EAGLE-3 trainer's
    epochs say (each partition extracted once)."""
    return 1 if config["train"]["method"] == "dflash" else int(config["train"]["epochs"])


def pinned_chain(config: dict, root: Path) -> Chain | None:
    """The chain a run of this directory started (``results/streaming/chain.json``), if it was
    made for the same partitions and epochs: a chain in progress keeps its shape whatever
    the budget says now (a rerun must not switch to a full extraction, nor re-plan the
    links already consumed)."""
    data = read_json(root / Layout.of(config).streaming_chain)
    if not data:
        return None
    chain = Chain(int(data["partitions"]), int(data["epochs"]), int(data["in_flight"]),
                  int(data.get("part_bytes", 0)))
    if (chain.partitions, chain.epochs) != (int(config["extract"]["partitions"]), chain_epochs(config)):
        return None
    return chain


def consumed_links(chain: Chain, stream_dir: str | os.PathLike) -> set[int]:
    """Links of ``chain`` whose consumed marker (of this very chain) is on disk."""
    done = set()
    for link in range(chain.links):
        data = read_json(Path(stream_dir) / consumed_name(link))
        if data and (data.get("partitions"), data.get("epochs")) == (chain.partitions, chain.epochs):
            done.add(link)
    return done


def write_chain(chain: Chain, layout: Layout) -> Path:
    """onstart of a streaming run: pin the chain (see :func:`pinned_chain`)."""
    path = Path(layout.streaming_chain)
    if read_json(path) != {**chain.to_json()}:
        write_json(path, chain.to_json())
    return path


def chain_from_budget(partitions: int, epochs: int, room_bytes: float,
                      part_bytes: int) -> tuple[Chain | None, str | None]:
    """The chain when ``room_bytes`` (the budget minus everything but the train split's
    hidden states) holds fewer than all partitions: (chain, None); (None, None) when all
    fit (no streaming); (None, why) when not even one partition fits."""
    fits = int(room_bytes // part_bytes) if part_bytes > 0 else partitions
    if fits >= partitions:
        return None, None
    if partitions < 2:
        return None, ("the train split's hidden states do not fit: stream them in partitions "
                      "with extract.partitions: N (N >= 2)")
    if fits < 1:
        return None, (f"not even one of the {partitions} partitions ({part_bytes:,} B of hidden "
                      f"states each) fits in the {max(0, int(room_bytes)):,} B left for them")
    return Chain(partitions, epochs, fits, part_bytes), None


# ----------------------------------------------------------------------------- consuming a link

def part_files(manifest: dict) -> list[Path]:
    """The files a partition manifest's shards occupy: each shard and its checksum sidecar."""
    shard_dir = Path(manifest["shard_dir"])
    out = []
    for entry in manifest["shards"]:
        shard = shard_dir / entry["file"]
        out += [shard, shard.with_suffix(".json")]
    return out


def log(message: str) -> None:
    print(f"streaming: {message}", file=sys.stderr, flush=True)


def train_link(link: int, chain: Chain, train_manifest: Path, eval_manifest: Path | None,
               previous: Path | None, stats: Path, vocab_map: Path | None, target: Path, cache_root: Path,
               out_dir: Path, config: dict, marker: Path, launch: list[str],
               previous_out_dir: Path | None = None, method: str = "eagle3") -> dict:
    """Train link ``link`` of the chain, then consume it (module docstring); returns the marker.

    ``launch``: the command that starts the trainer, its arguments added here
    (eagle3flow/train/launch.py trainer_command: this folder does not import train/).
    ``method``: the draft's kind, ``config`` its trainer's settings (the train section for
    eagle3, the dflash section for dflash, which reads no ``vocab_map``).

    ``out_dir`` gets train.py's outputs (the last link's are the workflow's); the previous
    link's run directory and ``previous_out_dir`` are deleted once this link is consumed.
    """
    t0 = time.time()
    with open(train_manifest) as f:
        manifest = json.load(f)
    init_from = None
    if previous is not None:
        before = read_json(previous)
        if not before or "checkpoint" not in before:
            raise ValueError(f"{previous}: not a consumed-link marker (no 'checkpoint')")
        # The previous link's job may have been killed after its marker, before its
        # deletions: nothing would delete its partition's shards then.
        freed = finish_consuming(before, cache_root)
        if freed:
            log(f"link {link}'s job was killed after its marker: deleted what it left ({freed / 1e6:,.1f} MB: "
                "its partition's shards, the link before's run)")
        init_from = before["checkpoint"]
        _keep_only(Path(init_from))
    split = read_json(stats) or {}
    try:
        schedule_tokens = int(split["splits"]["train"]["tokens"]) * chain.epochs
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{stats}: no splits.train.tokens (prepare_dataset's stats)") from None
    if method == "eagle3":
        if vocab_map is None:
            raise ValueError("an EAGLE-3 draft's link needs the vocabulary map (--vocab-map)")
        # The chain makes the epochs: each link is one pass over its partition.
        # The new train keys at their defaults stay off the trainer's command line, as train_draft's.
        link_config = {**omit_train_defaults(config), "epochs": 1}
    else:
        link_config = dict(config)   # dflash.steps span the chain; the trainer takes the link's share
    args = ["--train-manifest", str(train_manifest), "--target", str(target),
            "--out-dir", str(out_dir), "--cache-root", str(cache_root),
            "--config-json", json.dumps(link_config, sort_keys=True),
            "--schedule-tokens", str(schedule_tokens), "--data-epoch", str(chain.epoch_of(link))]
    if vocab_map is not None:
        args += ["--vocab-map", str(vocab_map)]
    if eval_manifest is not None:
        args += ["--eval-manifest", str(eval_manifest)]
    if method == "dflash" and link == chain.links - 1:
        args += ["--last-link"]      # ends at dflash.steps, whatever extraction cut off
    if init_from is not None:
        args += ["--init-from", init_from]
    log(f"link {link + 1}/{chain.links}: partition {chain.partition_of(link)} "
        f"({manifest['num_tokens']:,} tokens, {len(manifest['shards'])} shards), epoch "
        f"{chain.epoch_of(link) + 1}/{chain.epochs}"
        + (f", from {init_from}" if init_from else ", from scratch"))
    rc = subprocess.run([*launch, *args]).returncode
    if rc != 0:
        raise SystemExit(rc)

    result = read_json(out_dir / "eval.json") or {}
    checkpoint = Path(result.get("final_checkpoint", ""))
    if not (checkpoint / "state.pt").is_file():
        raise RuntimeError(f"{out_dir}/eval.json: training finished without its final checkpoint "
                           f"{checkpoint}/state.pt; not consuming link {link}")
    state = {
        "link": link, "partition": chain.partition_of(link), "epoch": chain.epoch_of(link),
        **{k: v for k, v in chain.to_json().items() if k != "part_bytes"},
        "checkpoint": str(checkpoint), "run_dir": str(checkpoint.parent), "step": result.get("steps"),
        "tokens_done": result.get("tokens_done"), "schedule_tokens": schedule_tokens,
        "hidden_states_fingerprint": manifest.get("fingerprint"), "shard_dir": manifest["shard_dir"],
        "shards": [{k: e.get(k) for k in ("file", "sha256", "bytes", "num_tokens")} for e in manifest["shards"]],
        "consumed_at": time.time(),
        # The part manifest itself (a temp() file, gone after this job): the record of
        # what was extracted, for results/hidden_states/train/manifest.json.
        "manifest_path": str(train_manifest), "manifest": manifest,
        # What consuming it deletes besides the shards (finish_consuming redoes it).
        "init_from": init_from, "previous_out_dir": str(previous_out_dir) if previous_out_dir else None,
    }
    write_json(marker, state)
    freed = finish_consuming(state, cache_root)
    log(f"link {link + 1}/{chain.links} consumed in {time.time() - t0:.0f}s: step {state['step']}, "
        f"{len(manifest['shards'])} shards deleted, {freed / 1e6:,.1f} MB freed -> {marker}")
    return state


def finish_consuming(state: dict, cache_root: Path) -> int:
    """Delete what a consumed link (its marker's ``state``) needs no more: its partition's
    shards, the previous link's run directory and out dir. Idempotent; returns the
    bytes freed (0 when it was all done already)."""
    freed = 0
    for path in part_files({"shard_dir": state["shard_dir"], "shards": state["shards"]}):
        try:
            freed += path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            pass
    # The previous link's run (and its intermediate outputs): this link's final
    # checkpoint now carries everything the chain needs.
    init_from = state.get("init_from")
    if init_from:
        old_run = Path(init_from).parent
        if (old_run.is_dir() and old_run.resolve() != Path(state["run_dir"]).resolve()
                and old_run.parent.resolve() == cache_root.resolve()):
            freed += _tree_bytes(old_run)
            shutil.rmtree(old_run, ignore_errors=True)
    previous_out_dir = Path(state["previous_out_dir"]) if state.get("previous_out_dir") else None
    if previous_out_dir is not None and previous_out_dir.is_dir():
        freed += _tree_bytes(previous_out_dir)
        shutil.rmtree(previous_out_dir, ignore_errors=True)
    return freed


def record_manifest(markers: list[Path], out: Path) -> dict:
    """``results/hidden_states/train/manifest.json`` of a streamed run: the first epoch's part
    manifests (kept in the consumed markers) joined, marked ``"streamed"``; its shards
    were deleted once consumed, so it records what was extracted and trained on (the
    report reads it), it is no input to train from. Their throughput logs are joined
    beside it (``throughput.jsonl``)."""
    parts = []
    for path in markers:
        data = read_json(path)
        if not data or "manifest" not in data:
            raise ValueError(f"{path}: not a consumed-link marker with its manifest")
        parts.append(data)
    parts.sort(key=lambda d: d["partition"])
    first = parts[0]["manifest"]
    record = {k: v for k, v in first.items() if k != "partition"}
    record["shards"] = [e for d in parts for e in d["manifest"]["shards"]]
    for key in SUMMED_KEYS:
        if key in first:
            record[key] = sum(int(d["manifest"].get(key, 0)) for d in parts)
    record["streamed"] = {"partitions": len(parts), "shards_deleted": True,
                          "consumed": [str(p) for p in markers]}
    merge_throughput_logs([throughput_path(Path(d["manifest_path"])) for d in parts],
                          out.parent / THROUGHPUT_FILE)
    write_json(out, record)
    log(f"{len(parts)} consumed partitions ({record['num_tokens']:,} tokens, "
        f"{len(record['shards'])} shards, deleted) recorded in {out}")
    return record


def _keep_only(checkpoint: Path) -> None:
    """Delete the other checkpoints of ``checkpoint``'s run (a finished link's older ones):
    the chain needs only its final one, until the next link is consumed."""
    for step_dir in checkpoint.parent.glob("step-*"):
        if step_dir.name != checkpoint.name and step_dir.is_dir():
            shutil.rmtree(step_dir, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> None:
    """python -m eagle3flow.ops.streaming record-manifest --marker consumed-0.json ... --manifest OUT

    python -m eagle3flow.ops.streaming train-link --link J --partitions N --epochs E --in-flight F \\
        --train-manifest PART.json [--eval-manifest EVAL.json] [--previous consumed-(J-1).json] \\
        --stats stats.json [--vocab-map V] --target T --cache-root cache/train --out-dir D \\
        [--method dflash] --config-json '{...}' --marker consumed-J.json -- python -m eagle3flow.train.launch ... --
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.ops.streaming", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train-link", help="train one link of the chain and consume its partition")
    p.add_argument("--link", type=int, required=True)
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--in-flight", type=int, required=True)
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--eval-manifest", default=None)
    p.add_argument("--previous", default=None, help="the previous link's consumed marker")
    p.add_argument("--stats", required=True, help="prepare_dataset's stats.json (the chain's tokens)")
    p.add_argument("--vocab-map", default=None, help="an EAGLE-3 draft's (a DFlash draft reads none)")
    p.add_argument("--method", choices=["eagle3", "dflash"], default="eagle3", help="the draft's kind (train.method)")
    p.add_argument("--target", required=True)
    p.add_argument("--cache-root", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--previous-out-dir", default=None, help="the previous link's out dir, deleted once consumed")
    p.add_argument("--config-json", default="{}", help="the trainer's settings: the train section (dflash: the "
                   "trainer's --config-json, the dflash section)")
    p.add_argument("--marker", required=True)
    p.add_argument("launch", nargs=argparse.REMAINDER,
                   help="after --: the command that starts the trainer (its arguments are added)")
    r = sub.add_parser("record-manifest", help="the train manifest of a streamed run, from its markers")
    r.add_argument("--marker", action="extend", nargs="+", required=True, help="consumed markers of the first epoch")
    r.add_argument("--manifest", required=True)
    args = parser.parse_args(argv)
    if args.command == "record-manifest":
        record_manifest([Path(m) for m in args.marker], Path(args.manifest))
        return
    chain = Chain(args.partitions, args.epochs, args.in_flight)
    if not 0 <= args.link < chain.links:
        parser.error(f"--link {args.link}: the chain has links 0..{chain.links - 1}")
    if (args.previous is None) != (args.link == 0):
        parser.error("--previous is required for every link but the first (and only then)")
    if args.method == "eagle3":
        if args.vocab_map is None:
            parser.error("--vocab-map is required for an EAGLE-3 draft")
        settings = cli_settings(parser, "train", args.config_json)
    else:
        # Checked here (a bad key fails before training); handed on as given, as train_draft does.
        cli_settings(parser, "dflash", args.config_json, borrowed=TARGET_BORROWED)
        settings = json.loads(args.config_json)
    train_link(args.link, chain, Path(args.train_manifest),
               Path(args.eval_manifest) if args.eval_manifest else None,
               Path(args.previous) if args.previous else None, Path(args.stats),
               Path(args.vocab_map) if args.vocab_map else None,
               Path(args.target), Path(args.cache_root), Path(args.out_dir), settings,
               Path(args.marker), args.launch[1:] if args.launch[:1] == ["--"] else args.launch,
               Path(args.previous_out_dir) if args.previous_out_dir else None, args.method)


if __name__ == "__main__":
    main()
