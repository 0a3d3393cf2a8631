"""The run at a glance: figures, tables and one JSON for machines, for `snakemake --report`.

Reads what the stages wrote (docs/formats.md) and writes into ``--out-dir``:

* ``training.png``, ``acceptance_per_position.png``, ``acceptance_vs_k.png``,
  ``vocab_coverage.png``, ``throughput.png`` (eagle3flow/report/plots.py);
* ``evaluation.html``: every draft on every prompt set in one table (acceptance
  length, per position, tokens/s with and without the draft, speedup, lossless),
  accepted draft tokens per category, acceptance length vs K;
* ``run.html``: service downtime, dataset and vocab stats, extraction and training
  summaries, the configuration;
* ``report.json``: the same numbers for machines.

The rule marks these with Snakemake's ``report()`` so ``snakemake --report
report.html`` embeds them in one self-contained HTML file.

Service downtime comes from ``--downtime`` (``results/service/downtime.json``, written
by the drain when a production vLLM unit was stopped for the GPU stages: a list, one
record per drain/restore cycle); without that file the report says that no service
was drained.
"""
from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

import yaml

from eagle3flow.report import plots
from eagle3flow.atomic import write_json
from eagle3flow.eval.temperature_table import temperature_note, temperature_rows
from eagle3flow.eval.agreement import NEAR_TIE_RULE, lossless_cell

FIGURES = {
    "training": "training.png",
    "acceptance_per_position": "acceptance_per_position.png",
    "acceptance_vs_k": "acceptance_vs_k.png",
    "vocab_coverage": "vocab_coverage.png",
    "throughput": "throughput.png",
}
NO_DOWNTIME = "no service drained"
STYLE = """<style>
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222}
table{border-collapse:collapse;margin:0.4em 0 1.4em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f2f2f2} td.l,th.l{text-align:left}
.fail{color:#b00;font-weight:bold} .pass{color:#070}
pre{background:#f7f7f7;padding:0.6em;font-size:12px;overflow:auto}
</style>"""


# ----------------------------------------------------------------------------- inputs

def read_json(path, what: str) -> dict:
    path = Path(path)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not JSON ({e})") from None


def read_jsonl(path, what: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{what}: {path}:{line_no} is not JSON ({e})") from None
    return rows


def training_metrics(path) -> list[dict]:
    """metrics.jsonl rows, the last row per step (a resumed run may log a step twice)."""
    by_step = {}
    for row in read_jsonl(path, "training metrics"):
        for key in ("step", "loss", "step_acc", "tokens_per_s"):
            if key not in row:
                raise ValueError(f"training metrics: {path}: a row has no {key!r}")
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def extraction_timing(manifest_paths: list) -> tuple[dict[str, list[dict]], list[dict]]:
    """Per split: the throughput.jsonl rows of the manifest's own extraction
    (fingerprint), the last per shard; and a summary row per manifest."""
    timing, summaries = {}, []
    for path in manifest_paths:
        manifest = read_json(path, "hidden-state manifest")
        split = manifest.get("split", Path(path).parent.name)
        rows = {}
        log = Path(path).parent / "throughput.jsonl"
        if log.is_file():
            for row in read_jsonl(log, "extraction throughput"):
                if row.get("fingerprint") == manifest.get("fingerprint"):
                    rows[row["shard"]] = row
        timing[split] = [rows[s] for s in sorted(rows)]
        compute_s = sum(r["compute_s"] for r in timing[split])
        tokens = sum(r["num_tokens"] for r in timing[split])
        summaries.append({"split": split, "samples": manifest.get("num_samples"),
                          "tokens": manifest.get("num_tokens"),
                          "shards": len(manifest.get("shards", [])),
                          "dtype": manifest.get("dtype"),
                          "aux_layer_ids": manifest.get("aux_layer_ids"),
                          "timed_shards": len(timing[split]), "compute_s": compute_s,
                          "tokens_per_s": tokens / compute_s if compute_s > 0 else None})
    return timing, summaries


# ----------------------------------------------------------------------------- HTML

def _e(x) -> str:
    return html.escape(str(x))


def _num(x, spec=".3f") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    return format(x, spec)


def _table(header: list[str], rows: list[list], left: int = 1, attrs: list[str] | None = None,
           table_id: str = "") -> str:
    """A table whose first ``left`` columns are left-aligned; cells are pre-escaped HTML."""
    head = "".join(f'<th class="{"l" if i < left else ""}">{_e(h)}</th>'
                   for i, h in enumerate(header))
    body = []
    for n, row in enumerate(rows):
        cells = "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(row))
        body.append(f"<tr {attrs[n] if attrs else ''}>{cells}</tr>")
    return (f'<table id="{table_id}"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table>')


def _lossless(lossless: dict) -> str:
    # Near-ties pass but are shown (eagle3flow/eval/agreement.py states the rule).
    return f'<span class="{"pass" if lossless["passed"] else "fail"}">{_e(lossless_cell(lossless))}</span>'


def temperature_html(summary: dict) -> list[str]:
    """Acceptance per sampling temperature beside greedy, every draft and set (none where
    the run sampled at no temperature)."""
    note = temperature_note(summary)
    if note is None:
        return []
    rows, attrs = [], []
    for r in temperature_rows(summary):
        inside = r["offline_within_ci"]
        p_value = "" if r["lossless_p_value"] is None else f" (p = {r['lossless_p_value']:.3f})"
        rows.append([_e(r["set"]), _e(r["draft"]),
                     "greedy" if r["temperature"] == 0 else _e(f"{r['temperature']:g}"),
                     _num(r["acceptance_length"]),
                     "" if r["ci_low"] is None else f"{_num(r['ci_low'])} &ndash; {_num(r['ci_high'])}",
                     _num(r["offline"]) + ("" if inside is None else
                                           (" (in interval)" if inside else ' <span class="fail">(outside interval)</span>')),
                     f'<span class="{"pass" if r["lossless_passed"] else "fail"}">'
                     f'{"pass" if r["lossless_passed"] else "FAIL"}{p_value}</span>'])
        attrs.append(f'data-set="{_e(r["set"])}" data-draft="{_e(r["draft"])}" '
                     f'data-temperature="{r["temperature"]:g}"')
    return [f"<h3>Acceptance per sampling temperature (vLLM, K = {summary['settings']['num_speculative_tokens']})</h3>",
            _table(["prompt set", "draft", "temperature", "acceptance length (vLLM)", "interval",
                    "offline estimate", "lossless"], rows, left=3, attrs=attrs,
                   table_id="by-temperature"),
            f"<p>{_e(note)}</p>"]


def evaluation_html(summary: dict) -> str:
    settings = summary["settings"]
    k = settings["num_speculative_tokens"]
    results = summary.get("results") or {}
    sets = summary.get("prompt_sets") or {}
    parts = [f"<html><head><meta charset='utf-8'>{STYLE}</head><body>",
             f"<h2>Drafts side by side (K = {k}, greedy, max_tokens {settings['max_tokens']}, "
             f"vLLM {_e(settings['vllm_version'])} on {_e(settings['device'])})</h2>"]
    rows, attrs = [], []
    for set_name, by_draft in results.items():
        for draft, r in by_draft.items():
            v = r["vllm"]
            rows.append([_e(set_name), _e(draft), _num(sets[set_name]["num_generations"]),
                         _num(v["acceptance_length"]), _num((r["simulated"] or {}).get("acceptance_length")),
                         " / ".join(_num(a, ".2f") for a in v["acceptance_rate_per_position"]),
                         _num(v["num_accepted_tokens"]),
                         _num(v["baseline_output_tokens_per_s"], ".1f"),
                         _num(v["eagle3_output_tokens_per_s"], ".1f"),
                         _num(v["speedup"], ".2f") + "x", _lossless(r["lossless"])])
            attrs.append(f'data-set="{_e(set_name)}" data-draft="{_e(draft)}"')
    parts.append(_table(["prompt set", "draft", "generations", "acceptance length (vLLM)",
                         "acceptance length (replay)", "acceptance per position",
                         "accepted draft tokens", "tokens/s without", "tokens/s with",
                         "speedup", "greedy outputs"], rows, left=2, attrs=attrs,
                        table_id="drafts"))
    parts.append(f"<p>Greedy outputs: {_e(NEAR_TIE_RULE)}; a near-tie is counted apart and does "
                 f"not fail the check, a real mismatch does.</p>")

    for set_name, by_draft in results.items():
        drafts = list(by_draft)
        categories = sorted({c for r in by_draft.values() for c in r["per_category"]})
        header = ["category", "generations"]
        for d in drafts:
            header += [f"{d}: accepted tokens", f"{d}: acceptance length"]
        rows, attrs = [], []
        for cat in categories:
            first = next(r["per_category"][cat] for r in by_draft.values() if cat in r["per_category"])
            row = [_e(cat), _num(first["generations"])]
            for d in drafts:
                c = by_draft[d]["per_category"].get(cat, {})
                row += [_num(c.get("vllm_accepted")), _num(c.get("vllm_acceptance_length"))]
            rows.append(row)
            attrs.append(f'data-category="{_e(cat)}"')
        src = sets[set_name]
        parts.append(f"<h3>{_e(set_name)}: accepted draft tokens per category "
                     f"({src['num_prompts']} prompts{', answered turn by turn' if src['multi_turn'] else ''}; "
                     f"<code>{_e(src['source'])}</code>)</h3>")
        parts.append(_table(header, rows, attrs=attrs, table_id=f"categories-{_e(set_name)}"))

    parts += temperature_html(summary)

    max_k = settings.get("replay_max_k") or k
    rows = [[_e(s), _e(d)] + [_num((r["acceptance_length_vs_k"] or {}).get(str(j))) for j in range(1, max_k + 1)]
            for s, by_draft in results.items() for d, r in by_draft.items()]
    parts.append("<h3>Acceptance length vs K (exact greedy replay on the baseline's outputs)</h3>")
    parts.append(_table(["prompt set", "draft"] + [f"K={j}" for j in range(1, max_k + 1)], rows,
                        left=2, table_id="acceptance-vs-k"))
    sweep = summary.get("vllm_k_sweep_by_draft") or {
        s: {summary.get("main_draft"): by_k} for s, by_k in (summary.get("vllm_k_sweep") or {}).items()}
    if any(by_k for by_draft in sweep.values() for by_k in by_draft.values()):
        rows = [[_e(s), _e(d), _num(int(x)), _num(v["acceptance_length"]),
                 _num(v["eagle3_output_tokens_per_s"], ".1f"), _num(v["speedup"], ".2f") + "x",
                 "identical" if v["lossless"] else '<span class="fail">differ</span>']
                for s, by_draft in sweep.items() for d, by_k in by_draft.items()
                for x, v in sorted(by_k.items(), key=lambda i: int(i[0]))]
        parts.append("<h3>vLLM at each K</h3>")
        parts.append(_table(["prompt set", "draft", "K", "acceptance length", "tokens/s", "speedup",
                             "greedy outputs"], rows, left=2, table_id="vllm-k-sweep"))
    split = summary.get("eval_split")
    if split:
        parts.append("<h3>Eval split, teacher-forced per-step accuracy</h3>")
        parts.append(_table([f"step {j + 1}" for j in range(len(split["step_accuracy"]))],
                            [[_num(a) for a in split["step_accuracy"]]], left=0,
                            table_id="step-accuracy"))
    parts.append("</body></html>")
    return "\n".join(parts)


def _kv_table(d: dict, table_id: str = "") -> str:
    rows = [[_e(k), _e(json.dumps(v) if isinstance(v, (dict, list)) else v)] for k, v in d.items()]
    return _table(["", ""], rows, left=2, table_id=table_id)


def run_html(info: dict) -> str:
    parts = [f"<html><head><meta charset='utf-8'>{STYLE}</head><body>", "<h2>Service downtime</h2>"]
    downtime = info["service_downtime"]
    if downtime is None:
        parts.append(f'<p id="service-downtime">{NO_DOWNTIME}</p>')
    else:
        # one table per drain/restore cycle (downtime.json is a list of them), then the records
        total = sum(float(cycle.get("downtime_s") or 0) for cycle in downtime)
        tables = "".join(_kv_table({k: v for k, v in cycle.items() if not isinstance(v, (dict, list))})
                         for cycle in downtime)
        parts.append(f'<div id="service-downtime"><p>{len(downtime)} drain/restore cycle(s), '
                     f"{total:.1f} s down in all</p>{tables}"
                     f"<pre>{_e(json.dumps(downtime, indent=2))}</pre></div>")

    dataset = info["dataset"]
    parts.append("<h2>Dataset</h2>")
    splits = dataset.get("splits") or {}
    parts.append(_table(["split", "samples", "tokens", "assistant tokens"],
                        [[_e(s), _num(v.get("samples")), _num(v.get("tokens")),
                          _num(v.get("assistant_tokens"))] for s, v in splits.items()],
                        table_id="dataset-splits"))
    parts.append(_kv_table({k: v for k, v in dataset.items() if k != "splits"}, "dataset-stats"))

    vocab = info["vocab"]
    parts.append("<h2>Draft vocabulary</h2>")
    parts.append(_kv_table({k: vocab.get(k) for k in ("target_vocab_size", "draft_vocab_size",
                                                      "assistant_tokens", "coverage")}, "vocab"))
    parts.append("<h2>Hidden-state extraction</h2>")
    ex = info["extraction"]
    parts.append(_table(["split", "samples", "tokens", "shards", "timed shards", "compute s",
                         "tokens/s", "dtype"],
                        [[_e(r["split"]), _num(r["samples"]), _num(r["tokens"]), _num(r["shards"]),
                          _num(r["timed_shards"]), _num(r["compute_s"], ".1f"),
                          _num(r["tokens_per_s"], ".0f"), _e(r["dtype"])] for r in ex],
                        table_id="extraction"))
    tr = info["training"]
    parts.append("<h2>Training</h2>")
    parts.append(_kv_table({k: tr.get(k) for k in ("steps", "final_loss", "final_step_acc",
                                                   "mean_tokens_per_s", "eval_step_accuracy")},
                           "training"))
    parts.append("<h2>Configuration</h2>")
    parts.append(f'<pre id="config">{_e(yaml.safe_dump(info["config"], sort_keys=False))}</pre>')
    parts.append("</body></html>")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- build

def build_report(out_dir, eval_summary, train_metrics, vocab_stats, dataset_stats, manifests,
                 train_eval=None, downtime=None, config: dict | None = None) -> dict:
    """Write every figure, both HTML pages and report.json into ``out_dir``; return the JSON."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = read_json(eval_summary, "evaluation summary")
    metrics = training_metrics(train_metrics)
    vocab = read_json(vocab_stats, "vocab stats")
    dataset = read_json(dataset_stats, "dataset stats")
    timing, extraction = extraction_timing(list(manifests))
    train_eval_data = read_json(train_eval, "training eval") if train_eval else {}
    downtime_data = None
    if downtime and Path(downtime).is_file():
        # the drain writes a list, one record per cycle (docs/formats.md); one record alone reads as one cycle
        downtime_data = read_json(downtime, "service downtime")
        if isinstance(downtime_data, dict):
            downtime_data = [downtime_data]

    plots.plot_training(metrics, out_dir / FIGURES["training"])
    plots.plot_acceptance_per_position(summary, out_dir / FIGURES["acceptance_per_position"])
    plots.plot_acceptance_vs_k(summary, out_dir / FIGURES["acceptance_vs_k"])
    plots.plot_vocab_coverage(vocab, out_dir / FIGURES["vocab_coverage"])
    plots.plot_throughput(timing, metrics, out_dir / FIGURES["throughput"])

    last = metrics[-1] if metrics else {}
    training = {"steps": last.get("step"), "final_loss": last.get("loss"),
                "final_step_acc": last.get("step_acc"),
                "mean_tokens_per_s": (sum(m["tokens_per_s"] for m in metrics) / len(metrics)
                                      if metrics else None),
                "eval_step_accuracy": train_eval_data.get("step_accuracy"),
                "metrics": [{k: m[k] for k in ("step", "loss", "step_acc", "tokens_per_s")}
                            for m in metrics]}
    info = {
        "evaluation": {k: v for k, v in summary.items() if k != "per_prompt"},
        "training": training,
        "vocab": vocab,
        "dataset": dataset,
        "extraction": extraction,
        "extraction_timing": timing,
        "service_downtime": downtime_data,
        "service_downtime_text": NO_DOWNTIME if downtime_data is None else None,
        "config": config or {},
        "figures": dict(FIGURES),
    }
    (out_dir / "evaluation.html").write_text(evaluation_html(summary))
    (out_dir / "run.html").write_text(run_html(info))
    write_json(out_dir / "report.json", info)
    print(f"report: wrote {len(FIGURES)} figures, evaluation.html, run.html and report.json "
          f"to {out_dir}", file=sys.stderr, flush=True)
    return info


def main(argv=None) -> None:
    """CLI.

    python -m eagle3flow.report.render --out-dir results/report \\
        --eval-summary results/eval/summary.json --train-metrics results/train/metrics.jsonl \\
        --train-eval results/train/eval.json --vocab-stats results/vocab/stats.json \\
        --dataset-stats results/dataset/stats.json \\
        --manifest results/hidden_states/train/manifest.json [MANIFEST ...] \\
        [--downtime results/service/downtime.json] [--config-json JSON]
    """
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.report.render", description=main.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--eval-summary", required=True)
    parser.add_argument("--train-metrics", required=True)
    parser.add_argument("--train-eval", default=None)
    parser.add_argument("--vocab-stats", required=True)
    parser.add_argument("--dataset-stats", required=True)
    parser.add_argument("--manifest", action="extend", nargs="+", default=[], help="one per split")
    parser.add_argument("--downtime", default=None, help="service downtime JSON, if any")
    parser.add_argument("--config-json", default=None, help="the workflow config, shown as is")
    args = parser.parse_args(argv)
    build_report(args.out_dir, args.eval_summary, args.train_metrics, args.vocab_stats,
                 args.dataset_stats, args.manifest, args.train_eval, args.downtime,
                 json.loads(args.config_json) if args.config_json else None)


if __name__ == "__main__":
    main()
