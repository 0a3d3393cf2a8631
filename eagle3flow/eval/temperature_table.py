"""Acceptance per temperature beside greedy, as the report and the model card show it:
rows read from summary.json (no numerics here, so the report needs neither torch nor
numpy for it)."""
from __future__ import annotations


def temperature_rows(summary: dict) -> list[dict]:
    """Acceptance per temperature beside greedy, for the report and the model card: one row
    per prompt set and draft and temperature (greedy first, from the keys it always had).

    Each row: ``{"set", "draft", "temperature", "acceptance_length", "ci_low", "ci_high",
    "offline", "offline_within_ci", "lossless_passed", "lossless_p_value"}``; the
    interval, the estimate and the p-value are null where they do not apply (greedy has
    the exact replay and its own lossless check)."""
    rows = []
    for set_name, by_draft in (summary.get("results") or {}).items():
        for draft, r in by_draft.items():
            rows.append({"set": set_name, "draft": draft, "temperature": 0.0,
                         "acceptance_length": r["vllm"]["acceptance_length"],
                         "ci_low": None, "ci_high": None,
                         "offline": (r.get("simulated") or {}).get("acceptance_length"),
                         "offline_within_ci": None,
                         "lossless_passed": r["lossless"]["passed"], "lossless_p_value": None})
            for block in (summary.get("by_temperature") or {}).values():
                hot = block["results"][set_name][draft]
                rows.append({"set": set_name, "draft": draft, "temperature": block["temperature"],
                             "acceptance_length": hot["vllm"]["acceptance_length"],
                             "ci_low": hot["vllm"]["ci_low"], "ci_high": hot["vllm"]["ci_high"],
                             "offline": (hot["offline"] or {}).get("acceptance_length"),
                             "offline_within_ci": (hot["offline"] or {}).get("within_ci"),
                             "lossless_passed": hot["lossless"]["passed"],
                             "lossless_p_value": hot["lossless"]["p_value"]})
    return rows


def temperature_note(summary: dict) -> str | None:
    """One sentence on how the rows at temperature were measured (None: greedy alone)."""
    settings = summary["settings"]
    if not summary.get("by_temperature"):
        return None
    block = next(iter(summary["by_temperature"].values()))
    block = next(r for by_draft in block["results"].values() for r in by_draft.values())
    return (f"At temperature: every prompt (MT-bench: its first turn) sampled "
            f"{settings['samples_per_prompt']} times with and without the draft, the same seeds "
            f"on both sides; draft sampling {settings.get('draft_sample_method')} "
            f"({settings.get('draft_sample_note')}). Interval: {block['vllm']['ci_method']}, "
            f"{settings['confidence']:.0%}. Offline: the expected acceptance under rejection "
            f"sampling along the target's own sampled answers (eagle3flow/train/rejection_estimate.py; "
            f"at greedy, the exact replay). Lossless at temperature: {block['lossless']['test']}, over "
            f"tokens 1..{settings['lossless_positions']}, failing below p = "
            f"{settings['lossless_false_alarm_rate']}.")
