"""Forget Snakemake's records of this workflow's temp flags once the flags are gone.

The drain flags (``drained_for_<stage>.<key>.flag``) and the preflight's ``ok*.json`` are
temp() outputs: each lives only while its run needs it. Snakemake keeps its metadata
record of such a file after deleting the file, and judges the rule by that record: a
changed command, parameter or input set of ``drain_service`` or a preflight rule (a new
version of the workflow, an edited drain setting, any config edit for the preflight,
which reads the whole config) then marks the job to run again, and with it every GPU
stage behind it, though their outputs are all there. A record of a file
that no longer exists describes nothing, so the workflow drops it when it is read, dry
runs too (so that ``snakemake -n`` and the plan show what the run will do): these jobs
then run only when a GPU stage must.

Snakemake's default file persistence (``.snakemake/metadata/``, one file per output named
by the urlsafe base64 of its path) is read; names split into folders (paths over ~190
characters) and other persistence backends are left alone.
"""
from __future__ import annotations

import base64
import binascii
import fnmatch
import os
from pathlib import Path

METADATA = Path(".snakemake") / "metadata"


def drop_stale_records(workdir: str | os.PathLike, patterns: list[str]) -> list[str]:
    """Delete the records of the files matching ``patterns`` (fnmatch, on the paths as the
    rules declare them, relative to ``workdir``) that do not exist; returns those paths."""
    records = Path(workdir) / METADATA
    try:
        names = os.listdir(records)
    except OSError:
        return []
    dropped = []
    for name in names:
        try:
            path = base64.urlsafe_b64decode(name).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            continue   # a folder of a split name ("@..."), or not Snakemake's
        if any(fnmatch.fnmatchcase(path, p) for p in patterns) and not (Path(workdir) / path).exists():
            try:
                (records / name).unlink()
            except OSError:
                continue   # gone already (another invocation), or not a file
            dropped.append(path)
    return dropped
