"""Where a run keeps what it makes: every artifact path the rules declare and the plan,
streaming and the drain read, under the config's ``paths`` (results/, cache/, logs/),
and the stage table (which rules make which folders, and what says a stage is done).

One home: a path named here is spelled nowhere else. No torch, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Stage(NamedTuple):
    """One stage of the plan: its rules (prefixes of rule names), whether it runs on the
    GPUs, the folders (``results/...``, ``cache/...``) whose bytes are its, and the file
    (under results/) whose existence says it is done, without Snakemake's DAG."""
    name: str
    rules: tuple[str, ...]
    gpu: bool
    folders: tuple[str, ...]
    done: tuple[str, ...]


# Stages in workflow order.
STAGES = (
    Stage("embedded target", ("build_embedded_target", "build_pretrained_target", "write_builtin_prompts"), False,
          ("results/embedded", "results/pretrained", "results/prompts"),
          ("embedded/build_stats.json", "pretrained/target/config.json")),
    Stage("prepare dataset", ("prepare_dataset",), False, ("results/dataset",), ("dataset/stats.json",)),
    # Answers come from the live server, before any drain: not a GPU stage of this run.
    Stage("regenerate", ("regenerate_responses",), False, ("results/regenerate", "cache/regenerate"),
          ("regenerate/stats.json",)),
    Stage("extract", ("extract_hidden_states", "extract_partition", "merge_hidden_states"), True,
          ("results/hidden_states", "cache/hidden_states"), ("hidden_states/eval/manifest.json",)),
    Stage("vocab", ("build_vocab_map",), False, ("results/vocab",), ("vocab/stats.json",)),
    Stage("train", ("train_draft", "train_partition"), True,
          ("results/train", "cache/train", "cache/streaming"), ("train/eval.json",)),
    Stage("export", ("export_draft",), False, ("results/draft",), ("draft/model.safetensors",)),
    Stage("evaluate", ("evaluate_draft",), True, ("results/eval",), ("eval/summary.json",)),
    Stage("report", ("build_report",), False, ("results/report",), ("report/report.json",)),
)
# A run's copy of the drain/restore cycles it took part in, in its service folder.
DOWNTIME_FILE = "downtime.json"
# Cache folders holding one subfolder per fingerprint, and how many of the newest are
# this run's (extraction keeps one per split): a rerun resumes those, the rest is stale.
FINGERPRINTED = {"cache/hidden_states": 2, "cache/train": 1, "cache/regenerate": 1}


@dataclass(frozen=True)
class Layout:
    """The run's folders (as the config gives them: relative to the working directory or
    absolute) and every artifact under them."""
    results: str = "results"
    cache: str = "cache"
    logs: str = "logs"

    @classmethod
    def of(cls, config: dict) -> "Layout":
        paths = config.get("paths") or {}
        return cls(results=paths.get("results") or "results", cache=paths.get("cache") or "cache",
                   logs=paths.get("logs") or "logs")

    def folder(self, rel: str) -> str:
        """A stage folder of STAGES (``results/...``, ``cache/...``) under this run's folders."""
        top, _, rest = rel.partition("/")
        return f"{getattr(self, top)}/{rest}"

    def _r(self, rel: str) -> str:
        return f"{self.results}/{rel}"

    # --- the target and the data ------------------------------------------------------
    @property
    def embedded_dir(self) -> str:
        return self._r("embedded")

    @property
    def embedded_target(self) -> str:
        return self._r("embedded/target")

    @property
    def embedded_conversations(self) -> str:
        return self._r("embedded/conversations.jsonl")

    @property
    def embedded_stats(self) -> str:
        return self._r("embedded/build_stats.json")

    @property
    def pretrained_target(self) -> str:
        return self._r("pretrained/target")

    @property
    def builtin_prompts(self) -> str:
        return self._r("prompts/builtin_prompts.jsonl")

    @property
    def target_identity(self) -> str:
        return self._r("target/identity.json")

    @property
    def target_config_identity(self) -> str:
        return self._r("target/config_identity.json")

    @property
    def regenerate_dir(self) -> str:
        return self._r("regenerate")

    @property
    def regenerated(self) -> str:
        """The target's own answers, the dataset's input when regenerate.enabled."""
        return self._r("regenerate/responses.jsonl")

    @property
    def regenerate_stats(self) -> str:
        return self._r("regenerate/stats.json")

    @property
    def regenerate_cache(self) -> str:
        return f"{self.cache}/regenerate"

    @property
    def original_answers_dir(self) -> str:
        return self._r("original_answers")

    def dataset(self, name: str) -> str:
        """train.parquet, eval.parquet, eval_prompts.jsonl, stats.json."""
        return self._r(f"dataset/{name}")

    # --- hidden states ----------------------------------------------------------------
    @property
    def hidden_states_cache(self) -> str:
        return f"{self.cache}/hidden_states"

    def hidden_states_manifest(self, split: str) -> str:
        return self._r(f"hidden_states/{split}/manifest.json")

    def partition_manifest(self, parts: int) -> str:
        """One extraction partition's manifest; wildcards {split} and {part}."""
        return self._r(f"hidden_states/{{split}}/part-{{part}}-of-{parts}.json")

    @property
    def streamed_partition_manifest(self) -> str:
        """One streaming link's partition manifest; wildcards {link}, {split}, {part}, {partitions}."""
        return self._r("hidden_states/stream/link-{link}/{split}-part-{part}-of-{partitions}.json")

    # --- vocabulary, training, the draft ---------------------------------------------
    @property
    def vocab_map(self) -> str:
        return self._r("vocab/vocab_map.safetensors")

    @property
    def vocab_stats(self) -> str:
        return self._r("vocab/stats.json")

    def train(self, name: str) -> str:
        """draft.safetensors, draft_config.json, metrics.jsonl, eval.json."""
        return self._r(f"train/{name}")

    @property
    def train_cache(self) -> str:
        return f"{self.cache}/train"

    @property
    def streaming_dir(self) -> str:
        return self._r("streaming")

    @property
    def streaming_chain(self) -> str:
        """The chain a streaming run started, pinned for its reruns."""
        return self._r("streaming/chain.json")

    @property
    def streaming_cache(self) -> str:
        return f"{self.cache}/streaming"

    def draft_dir(self, fmt_index: int = 0, fmt: str = "eagle3") -> str:
        """export.formats: the first to results/draft/, each other to results/draft-<format>/."""
        return self._r("draft" if fmt_index == 0 else f"draft-{fmt}")

    @property
    def model_card(self) -> str:
        return self._r("draft/README.md")

    @property
    def published(self) -> str:
        return self._r("draft/published.json")

    @property
    def eval_summary(self) -> str:
        return self._r("eval/summary.json")

    @property
    def report_dir(self) -> str:
        return self._r("report")

    # --- the run's own records ---------------------------------------------------------
    @property
    def service_dir(self) -> str:
        """This run's drain records (the unit's session lives in the unit's state folder)."""
        return self._r("service")

    @property
    def downtime(self) -> str:
        return f"{self.service_dir}/{DOWNTIME_FILE}"

    def drain_flag(self, stage: str, key: str) -> str:
        return self._r(f"service/drained_for_{stage}.{key}.flag")

    @property
    def drain_flags(self) -> str:
        return self._r("service/drained_for_*.flag")

    @property
    def preflight_ok(self) -> str:
        return self._r("preflight/ok.json")

    @property
    def preflight_for_drain(self) -> str:
        """One per drain job; wildcards {stage} and {key}."""
        return self._r("preflight/ok_for_{stage}.{key}.json")

    @property
    def preflight_records(self) -> str:
        return self._r("preflight/ok*.json")

    @property
    def plan_dir(self) -> str:
        return self._r("plan")

    @property
    def plan_throughputs(self) -> str:
        """The throughputs earlier runs measured, per profile, for the next plan."""
        return self._r("plan/throughput.json")

    @property
    def benchmarks(self) -> str:
        return self._r("benchmarks")
