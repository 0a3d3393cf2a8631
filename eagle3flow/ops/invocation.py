"""Does this Snakemake invocation run jobs? Decided from its command line.

The workflow does a few things when it is read that only a run may do (clear a dead
run's lock, drop a dead run's drain flags). Snakemake has no API that says, while the
Snakefile is parsed, whether it will run jobs: its executor is chosen afterwards. So
the command line is parsed with Snakemake's own argument parser, and anything but a
plain run (a dry run, --lint, --report, --unlock, --summary, --list-*, --dag,
--touch, ...) counts as "no jobs": the workflow then changes nothing.
"""
from __future__ import annotations

import sys

# Options of Snakemake's parser (their dest) under which it runs no job. A dest that is
# set (true or a value) means "no jobs"; dests a Snakemake version lacks are skipped.
NO_JOB_DESTS = (
    "dryrun", "lint", "report", "report_stylesheet", "unlock", "summary", "detailed_summary",
    "list_rules", "list_target_rules", "list_changes", "list_code_changes", "list_input_changes",
    "list_params_changes", "list_untracked", "list_conda_envs", "dag", "rulegraph",
    "filegraph", "d3dag", "touch", "archive", "cleanup_metadata", "cleanup_shadow",
    "delete_all_output", "delete_temp_output", "containerize", "print_compilation",
    "export_cwl", "generate_unit_tests", "conda_create_envs_only", "conda_cleanup_envs",
    "cleanup_containers", "lockdir_only", "edit_notebook", "show_failed_logs_only",
    "draft_notebook", "mode_graph",
)


def runs_jobs(argv: list[str] | None = None) -> bool:
    """True when ``argv`` (default: this process's) is a Snakemake command that runs jobs.
    Anything that cannot be read as one (not snakemake, an unknown option) is False:
    when in doubt, change nothing."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) > 2 and argv[1] == "-m" and argv[2] == "snakemake":     # python -m snakemake
        args = argv[3:]
    elif argv and "snakemake" in argv[0]:         # the snakemake script, or snakemake/__main__.py
        args = argv[1:]
    else:
        return False
    try:
        # inside the try: a Snakemake whose parser cannot be imported is one more "cannot tell"
        from snakemake.cli import get_argument_parser

        parsed, _ = get_argument_parser().parse_known_args(args)
    except (Exception, SystemExit):
        return False
    return not any(getattr(parsed, dest, None) for dest in NO_JOB_DESTS)
