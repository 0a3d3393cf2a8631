"""publish_draft: the exported draft and its model card to the Hugging Face Hub.

Uploads ``results/draft/`` (config.json, model.safetensors, README.md) to ``hub.repo_id``
with huggingface_hub, creating the repository (private unless ``hub.private: false``) if
needed. The token comes only from the environment variable ``hub.token_env`` (default
``HF_TOKEN``): never from the config or the command line, never printed. ``hub.dry_run``
stops right before the first network call and prints what would be uploaded, so the rule
can be checked offline.

CLI (the settings: the config's hub section)::

    python -m eagle3flow.export.publish --draft results/draft --record results/draft/published.json
        --config-json '{"repo_id": "org/name", "token_env": "HF_TOKEN", "private": true, "dry_run": false}'
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from eagle3flow.config import cli_settings

FILES = ("config.json", "model.safetensors", "README.md")


class PublishError(RuntimeError):
    pass


def plan(draft: Path, repo_id: str, token_env: str) -> dict:
    """What would be uploaded; refuses a missing file, repo id or token before any network."""
    if not repo_id or repo_id.count("/") != 1:
        raise PublishError(f"hub.repo_id {repo_id!r}: set it to <user or org>/<name>")
    missing = [name for name in FILES if not (draft / name).is_file()]
    if missing:
        raise PublishError(f"{draft}: missing {missing} (run the workflow up to write_model_card first)")
    if not os.environ.get(token_env):
        raise PublishError(f"no token in ${token_env} (hub.token_env): export it in the shell that runs "
                           f"the workflow; it is read from there only")
    return {"repo_id": repo_id, "files": {name: (draft / name).stat().st_size for name in FILES}}


def publish(draft: Path, repo_id: str, token_env: str, private: bool, dry_run: bool) -> dict:
    what = plan(draft, repo_id, token_env)
    print(f"publish: {repo_id} <- " + ", ".join(f"{n} ({s:,} B)" for n, s in what["files"].items()),
          file=sys.stderr)
    if dry_run:
        print("publish: dry run (hub.dry_run): nothing was uploaded", file=sys.stderr)
        return {**what, "dry_run": True}
    from huggingface_hub import HfApi    # only a real upload needs the Hub client

    api = HfApi(token=os.environ[token_env])
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, folder_path=str(draft), allow_patterns=list(FILES),
                               commit_message="EAGLE-3 draft (eagle3flow)")
    return {**what, "dry_run": False, "commit": str(getattr(commit, "oid", commit)), "at": time.time()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.export.publish", description=__doc__.split("\n")[0])
    parser.add_argument("--draft", required=True, type=Path)
    parser.add_argument("--record", required=True, type=Path)
    parser.add_argument("--config-json", default="{}", help="the hub section")
    args = parser.parse_args(argv)
    hub = cli_settings(parser, "hub", args.config_json)
    try:
        record = publish(args.draft, hub["repo_id"], hub["token_env"], hub["private"], hub["dry_run"])
    except PublishError as error:
        print(f"publish: error: {error}", file=sys.stderr)
        return 1
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
