"""The report stage: figures, tables and report.json from the stages' files, and a small
Snakemake report rendered in headless Chromium (the embedded workflow's full report is
checked at the end of tests/test_workflow.py's end-to-end test)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3flow.report.render import FIGURES, NO_DOWNTIME, build_report
from support.report_checks import check_report

BIN = Path(sys.executable).parent


def acceptance(al: float, k: int) -> dict:
    return {"acceptance_length": al, "acceptance_rate_per_position": [0.6 / (j + 1) for j in range(k)],
            "num_drafts": 10, "num_accepted_tokens": int((al - 1) * 10),
            "num_accepted_tokens_per_pos": [5] * k}


def fake_stage_outputs(root: Path, downtime: list | None = None) -> dict:
    """The files the stages write (docs/formats.md), small but in their real formats."""
    k, max_k = 3, 5
    result = {
        "vllm": {**acceptance(1.8, k), "num_draft_tokens": 30, "baseline_output_tokens_per_s": 100.0,
                 "eagle3_output_tokens_per_s": 150.0, "speedup": 1.5},
        "simulated": acceptance(1.79, k),
        "lossless": {"passed": True, "num_prompts": 4, "num_mismatched": 0, "mismatched_ids": []},
        "acceptance_length_vs_k": {str(j): 1 + 0.3 * j for j in range(1, max_k + 1)},
        "per_category": {"writing": {"generations": 2, "vllm_accepted": 5, "vllm_acceptance_length": 1.5},
                         "math": {"generations": 2, "vllm_accepted": 7, "vllm_acceptance_length": 1.7}},
    }
    summary = {
        "settings": {"num_speculative_tokens": k, "max_tokens": 16, "vllm_version": "0.32.0",
                     "device": "cpu", "replay_max_k": max_k},
        "main_draft": "draft",
        "prompt_sets": {"eval": {"source": "eval_prompts.jsonl", "num_prompts": 4, "num_generations": 4,
                                 "multi_turn": False}},
        "results": {"eval": {"draft": result, "old": {**result, "lossless": {
            "passed": False, "num_prompts": 4, "num_mismatched": 1, "mismatched_ids": ["p1"]}}}},
        "vllm_k_sweep": {"eval": {"2": {"acceptance_length": 1.6, "eagle3_output_tokens_per_s": 140.0,
                                        "speedup": 1.4, "lossless": True}}},
        "eval_split": {"step_accuracy": [0.7, 0.6, 0.5]},
    }
    summary["settings"].update(samples_per_prompt=8, confidence=0.95, lossless_positions=4,
                               lossless_false_alarm_rate=0.01, draft_sample_method="probabilistic",
                               draft_sample_note="vLLM's", temperatures=[0.0, 0.6])
    hot = lambda al, passed: {  # noqa: E731
        "vllm": {"acceptance_length": al, "ci_low": al - 0.1, "ci_high": al + 0.1,
                 "ci_method": "percentile bootstrap over prompts"},
        "offline": {"acceptance_length": al + 0.05, "within_ci": True},
        "lossless": {"passed": passed, "p_value": 0.4 if passed else 0.001, "test": "permutation"}}
    summary["by_temperature"] = {"0.6": {"temperature": 0.6, "samples_per_prompt": 8,
                                         "results": {"eval": {"draft": hot(1.6, True), "old": hot(1.4, False)}}}}
    paths = {"eval_summary": root / "eval" / "summary.json", "train_metrics": root / "train" / "metrics.jsonl",
             "vocab_stats": root / "vocab" / "stats.json", "dataset_stats": root / "dataset" / "stats.json",
             "manifests": [root / "hidden_states" / s / "manifest.json" for s in ("train", "eval")]}
    for p in [*paths["manifests"], paths["eval_summary"], paths["train_metrics"], paths["vocab_stats"],
              paths["dataset_stats"]]:
        p.parent.mkdir(parents=True, exist_ok=True)
    paths["eval_summary"].write_text(json.dumps(summary))
    with open(paths["train_metrics"], "w") as f:
        for step in range(10, 110, 10):
            f.write(json.dumps({"step": step, "loss": 5 / step ** 0.3, "step_acc": [0.5, 0.4, 0.3],
                                "tokens_per_s": 1000 + step}) + "\n")
    paths["vocab_stats"].write_text(json.dumps({"draft_vocab_size": 512, "coverage": 0.8,
                                                "coverage_at_size": {"128": 0.5, "512": 0.8, "2048": 0.97}}))
    paths["dataset_stats"].write_text(json.dumps({"splits": {"train": {"samples": 90, "tokens": 9000},
                                                             "eval": {"samples": 10, "tokens": 1000}}}))
    for i, manifest in enumerate(paths["manifests"]):
        manifest.write_text(json.dumps({"split": manifest.parent.name, "fingerprint": f"fp{i}",
                                        "num_samples": 10, "num_tokens": 1000, "shards": [{}, {}]}))
        with open(manifest.parent / "throughput.jsonl", "w") as f:
            for shard in range(2):
                f.write(json.dumps({"split": manifest.parent.name, "fingerprint": f"fp{i}", "shard": shard,
                                    "num_tokens": 500, "compute_s": 1.0 + shard,
                                    "finished_at": 1000.0 + 10 * i + 3 * shard}) + "\n")
            # A shard of an older extraction (other fingerprint) is not this run's.
            f.write(json.dumps({"split": "x", "fingerprint": "old", "shard": 0, "num_tokens": 1,
                                "compute_s": 1, "finished_at": 0}) + "\n")
    if downtime is not None:
        paths["downtime"] = root / "service" / "downtime.json"
        paths["downtime"].parent.mkdir(parents=True)
        paths["downtime"].write_text(json.dumps(downtime))
    return paths


def test_build_report_writes_figures_tables_and_json(tmp_path):
    paths = fake_stage_outputs(tmp_path / "results")
    out = tmp_path / "report"
    info = build_report(out, paths["eval_summary"], paths["train_metrics"], paths["vocab_stats"],
                        paths["dataset_stats"], paths["manifests"], downtime=tmp_path / "none.json",
                        config={"evaluate": {"num_speculative_tokens": 3}})
    for name in FIGURES.values():
        data = (out / name).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 5000, name
    page = (out / "evaluation.html").read_text()
    table = page.split('id="drafts"')[1].split("</table>")[0]
    assert 'data-set="eval" data-draft="draft"' in table and 'data-set="eval" data-draft="old"' in table
    assert "1/4 differ" in table and "1.50x" in table
    assert 'id="vllm-k-sweep"' in page and 'id="acceptance-vs-k"' in page
    # Acceptance per temperature beside greedy, every draft, with its interval and checks.
    hot = page.split('id="by-temperature"')[1].split("</table>")[0]
    assert hot.count("<tr data-set=") == 4                     # 2 drafts x (greedy, 0.6)
    assert 'data-draft="draft" data-temperature="0"' in hot and 'data-draft="draft" data-temperature="0.6"' in hot
    assert "1.500 &ndash; 1.700" in hot and "1.650 (in interval)" in hot and "FAIL (p = 0.001)" in hot
    assert "percentile bootstrap over prompts" in page
    run = (out / "run.html").read_text()
    assert f'<p id="service-downtime">{NO_DOWNTIME}</p>' in run
    assert "num_speculative_tokens: 3" in run
    saved = json.loads((out / "report.json").read_text())
    assert saved["service_downtime"] is None and saved["service_downtime_text"] == NO_DOWNTIME
    assert saved["evaluation"]["results"]["eval"]["draft"]["vllm"]["speedup"] == 1.5
    # Only this extraction's shards (fingerprint) are timed.
    assert [r["timed_shards"] for r in info["extraction"]] == [2, 2]
    assert info["extraction"][0]["tokens_per_s"] == pytest.approx(1000 / 3)
    assert saved["training"]["steps"] == 100


def test_report_shows_service_downtime_when_recorded(tmp_path):
    """downtime.json as the drain writes it: a list, one record per drain/restore cycle."""
    cycles = [{"unit": "vllm-kimi.service", "downtime_s": 1234.5, "stages": ["extract_hidden_states"]},
              {"unit": "vllm-kimi.service", "downtime_s": 65.5, "stages": ["evaluate_draft"]}]
    paths = fake_stage_outputs(tmp_path / "results", downtime=cycles)
    info = build_report(tmp_path / "report", paths["eval_summary"], paths["train_metrics"],
                        paths["vocab_stats"], paths["dataset_stats"], paths["manifests"],
                        downtime=paths["downtime"])
    run = (tmp_path / "report" / "run.html").read_text()
    assert NO_DOWNTIME not in run and "vllm-kimi.service" in run and "1234.5" in run and "65.5" in run
    assert "2 drain/restore cycle(s), 1300.0 s down in all" in run
    assert [c["downtime_s"] for c in info["service_downtime"]] == [1234.5, 65.5]


def test_report_names_the_bad_file(tmp_path):
    paths = fake_stage_outputs(tmp_path / "results")
    paths["train_metrics"].write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: a row has no 'loss'"):
        build_report(tmp_path / "report", paths["eval_summary"], paths["train_metrics"],
                     paths["vocab_stats"], paths["dataset_stats"], paths["manifests"])
    paths = fake_stage_outputs(tmp_path / "results2")
    with pytest.raises(FileNotFoundError, match="vocab stats: .*missing.json"):
        build_report(tmp_path / "report", paths["eval_summary"], paths["train_metrics"],
                     tmp_path / "missing.json", paths["dataset_stats"], paths["manifests"])


SNAKEFILE = '''
report: "workflow.rst"

rule all:
    input: "out/report/training.png", "out/report/evaluation.html"

rule figures:
    output:
        png=report("out/report/training.png", caption="caption.rst", category="Training"),
        html=report("out/report/evaluation.html", caption="caption.rst", category="Evaluation"),
    log: "logs/figures.log"
    shell:
        "{PYTHON} -m eagle3flow.report.render --out-dir out/report --eval-summary {EVAL}"
        " --train-metrics {METRICS} --vocab-stats {VOCAB} --dataset-stats {DATASET} {MANIFESTS}"
        " > {{log}} 2>&1"
'''


def test_snakemake_report_renders_in_chromium(tmp_path):
    """A real `snakemake --report` of the report stage's outputs, rendered in Chromium:
    the check the end-to-end test applies to the embedded workflow's report."""

    paths = fake_stage_outputs(tmp_path / "results")
    wf = tmp_path / "wf"
    wf.mkdir()
    (wf / "workflow.rst").write_text("A test workflow.\n")
    (wf / "caption.rst").write_text("A figure of the test workflow.\n")
    (wf / "Snakefile").write_text(SNAKEFILE.format(
        PYTHON=sys.executable, EVAL=paths["eval_summary"], METRICS=paths["train_metrics"],
        VOCAB=paths["vocab_stats"], DATASET=paths["dataset_stats"],
        MANIFESTS=" ".join(f"--manifest {m}" for m in paths["manifests"])))
    t0 = time.monotonic()
    for args in (["-c1"], ["--report", "report.html"]):
        result = subprocess.run([str(BIN / "snakemake"), *args], cwd=wf, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    probe = check_report(wf / "report.html", tmp_path / "chromium", figures=["training.png"],
                         pages={"evaluation.html": ['data-draft="old"']})
    print(f"snakemake run + report + Chromium: {time.monotonic() - t0:.1f}s")
    assert len(probe["images"]) == 1
