"""The GPU lane's result files (EAGLE3FLOW_GPU_RESULTS, one per pytest run) -> a Markdown
table: versions, then each test's outcome, time and measured values.

    python tests/gpu/write_results.py --command "..." results1.json [results2.json ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:.7g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(", ", ": "))
    return str(value)


def render(runs: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", ""]
    for n, run in enumerate(runs, 1):
        versions = ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items())
        lines += [f"Run {n} ({run.get('started')} to {run.get('finished')}, exit status "
                  f"{run.get('exitstatus')}): {versions}", "",
                  "| test | outcome | seconds | measured |", "| --- | --- | --- | --- |"]
        for nodeid, row in run["tests"].items():
            measured = "; ".join(f"{k}: {_value(v)}" for k, v in (row.get("measured") or {}).items())
            lines.append(f"| `{nodeid}` | {row['outcome']} | {row['seconds']} | {measured} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--command", required=True, help="the command the runs were made with")
    parser.add_argument("results", nargs="+")
    args = parser.parse_args()
    print(render([json.loads(Path(p).read_text()) for p in args.results], args.command))


if __name__ == "__main__":
    main()
