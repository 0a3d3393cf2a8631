"""The plan's stages (which rules, GPU or not, which paths hold their bytes) and the
plan itself: :class:`StageRow` per stage, :class:`Plan` for the run. Where a stage's
paths lie under the config's ``paths``, what they hold now, and whether a stage is
done without Snakemake's DAG. No torch."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3flow.layout import FINGERPRINTED, STAGES, Layout, Stage
from eagle3flow.ops.plan.sizes import tree_bytes

__all__ = ["FINGERPRINTED", "STAGES", "Plan", "StageRow", "measure", "real_path", "stage_outputs_exist"]

@dataclass
class StageRow:
    """One line of the plan."""
    name: str
    gpu: bool
    status: str                 # "run", "cached", "skip" (not needed by the targets)
    bytes: int                  # projected bytes this stage's paths hold at the end
    bytes_basis: str
    seconds: float
    time_basis: str
    jobs: int = 0               # jobs Snakemake will run for it
    actual_bytes: int | None = None
    actual_seconds: float | None = None


@dataclass
class Plan:
    stages: list[StageRow]
    other_bytes: int            # results/ and cache/ bytes no stage accounts for
    peak_bytes: int             # projected peak of results/ + cache/
    to_write_bytes: int         # bytes still to be written by stages that run
    gpus: int
    drain: bool
    workload: dict
    profile_key: str
    refusal: str | None = None
    actual_peak_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    restart_seconds: float = 0.0    # the drained unit's own load, after the last GPU stage

    @property
    def gpu_seconds(self) -> float:
        return sum(s.seconds for s in self.stages if s.gpu and s.status == "run")

    @property
    def downtime_seconds(self) -> float:
        """With a drain: from the first GPU stage that runs to the last one (CPU stages in
        between, like export, keep the unit down too); else nothing is drained."""
        if not self.drain:
            return 0.0
        running = [i for i, s in enumerate(self.stages) if s.status == "run"]
        gpu_running = [i for i in running if self.stages[i].gpu]
        if not gpu_running:
            return 0.0
        lo, hi = gpu_running[0], gpu_running[-1]
        return sum(self.stages[i].seconds for i in running if lo <= i <= hi) + self.restart_seconds

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(gpu_hours=self.gpu_seconds * max(self.gpus, 1) / 3600 if self.gpus else 0.0,
                    downtime_s=self.downtime_seconds)
        return data


def real_path(rel: str, config: dict, root: Path) -> Path:
    return root / Layout.of(config).folder(rel)


def measure(config: dict, root: Path) -> tuple[dict[str, int], int]:
    """Bytes now held per stage, and the results/ + cache/ total."""
    per_stage = {stage.name: sum(tree_bytes(real_path(p, config, root)) for p in stage.folders)
                 for stage in STAGES}
    layout = Layout.of(config)
    total = sum(tree_bytes(root / d) for d in {layout.results, layout.cache})
    return per_stage, total


def stage_outputs_exist(stage: Stage, config: dict, root: Path) -> bool:
    """Without Snakemake's DAG: a stage counts as done when a file saying so exists."""
    results = root / Layout.of(config).results
    return any((results / marker).is_file() for marker in stage.done)
