"""What makes an evaluation resumable: cheap identities of model dirs, request
fingerprints, and vLLM runs kept next to ``summary.json`` and reused when the request
is the same."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.serving.vllm_runner import run_vllm


def file_stamp(path: Path) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def dir_stamp(path: Path) -> list:
    """Cheap identity of a model dir: name, size and mtime of every file (never hashes weights)."""
    path = Path(path)
    return [file_stamp(p) for p in sorted(path.iterdir()) if p.is_file()]


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]



def cached_vllm_run(name: str, request: dict, out_dir: Path, python: str | None) -> dict:
    """Run vLLM unless ``out_dir/name.json`` already holds this request's result."""
    out = out_dir / f"{name}.json"
    key = fingerprint(request)
    if out.is_file():
        try:
            with open(out) as f:
                cached = json.load(f)
            if cached.get("request_fingerprint") == key:
                print(f"evaluate: reusing {out}", file=sys.stderr, flush=True)
                return cached
        except ValueError:
            pass
    sets = request.get("sets") or [{"prompts": request.get("prompts") or []}]
    generations = sum(len(s.get("prompts") or []) + sum(len(c["turns"]) for c in
                                                        s.get("conversations") or [])
                      for s in sets)
    print(f"evaluate: vLLM {name} run, {generations} generations in {len(sets)} prompt sets "
          f"(log: {out_dir / (name + '.log')})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    result = run_vllm(request, out, python=python, log_path=out_dir / f"{name}.log")
    result["request_fingerprint"] = key
    write_json(out, result)
    print(f"evaluate: vLLM {name} done in {time.monotonic() - t0:.0f}s "
          f"({result['output_tokens_per_s']:.1f} output tokens/s)", file=sys.stderr, flush=True)
    return result
