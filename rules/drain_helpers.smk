# Helpers of rules/drain.smk and the workflow's onstart/onsuccess/onerror (the flags and
# the stage wrapper the GPU rules take are in rules/common.smk).
# Frees the GPUs for the GPU stages on a box whose vLLM systemd unit holds them all,
# and brings the unit back (eagle3flow/ops/drain/service.py; what it does: docs/service.md).
#
# One drain job per GPU stage (a temp() flag the stage takes as input): Snakemake
# schedules it only when that stage has to run, after the stage's other inputs
# exist, so production stays up while the CPU stages before it run. Every GPU rule's
# one command is eagle3flow.ops.drain.gpu_stage, which runs the stage and hands its real exit
# status to the drain: the unit comes back after the last GPU stage of the run (or a
# failed one); onsuccess/onerror and a detached watchdog restore it in every other case.
import glob
import sys


def drained_stage_inputs(wildcards):
    """A drain job waits for the same inputs as its GPU job (not the flag itself)."""
    fixed = {"extract_hidden_states": EXTRACT_INPUTS, "train_draft": TRAIN_INPUTS,
             "evaluate_draft": EVALUATE_INPUTS}
    if wildcards.stage in fixed:
        return fixed[wildcards.stage]
    return streaming_drain_inputs(wildcards.stage, wildcards.key)


def write_drain_plan():
    """onstart: register the run with the unit, with the drained stages it will run, so
    that a stage's end knows whether the GPUs are needed again or the unit can come back,
    and so that no other run's restore starts the unit under this run's stages."""
    from eagle3flow.ops.drain.state import ServiceError, write_plan

    if not DRAIN["unit"]:
        return      # the first drain job says what to set
    # One entry per job: streaming alternates extraction and training jobs.
    stages = [job.rule.name for job in workflow.dag.needrun_jobs() if job.rule.name in DRAINED_STAGES]
    try:
        write_plan(DRAIN, SERVICE_DIR, sorted(stages), os.getpid(), run_id=RUN_ID)
    except ServiceError as error:
        raise WorkflowError(str(error))


def restore_service(reason):
    """onsuccess/onerror: this run needs the unit no more: bring it back if the run left it
    drained and no other run still needs it down."""
    from eagle3flow.ops.drain.restore import restore_if_drained
    from eagle3flow.ops.drain.state import ServiceError, State, restore_command

    for flag in glob.glob(LAYOUT.drain_flags):
        os.remove(flag)
    if not DRAIN["enabled"] or not UNIT_STATE_DIR:
        return
    try:
        restore_if_drained(DRAIN, reason, RUN_ID)
    except ServiceError as error:   # it names the command to run
        print(f"\n!!! {error}", file=sys.stderr)
    except Exception as error:  # any other failure is as loud; the watchdog retries once Snakemake has exited
        print(f"\n!!! the unit could not be restored: {error!r}\n"
              f"!!! once the cause is fixed: {restore_command(State(UNIT_STATE_DIR))}", file=sys.stderr)


def print_downtime():
    """The run's drain/restore cycles, for the summary at the end of the run."""
    from eagle3flow.ops.drain.state import run_summary

    if not DRAIN["enabled"]:
        return
    summary = run_summary(SERVICE_DIR, RUN_ID)
    if summary:
        print(f"\n=== service downtime ({LAYOUT.downtime}) ===\n{summary}")


def drop_stale_drain_flags():
    """A drain flag is only true while its run holds the unit drained: one left behind by
    a dead run must not let a GPU stage start on a running service (the stage wrapper
    refuses then anyway). Only a run does this, and only when no live run of this results
    folder is in the unit's session: a dry run or a second terminal changes nothing."""
    from eagle3flow.ops.drain.state import ServiceError, State, run_record, session_runs
    from eagle3flow.procfs import verdict

    flags = glob.glob(LAYOUT.drain_flags)
    if not flags:
        return
    if UNIT_STATE_DIR:
        state = State(UNIT_STATE_DIR)
        try:
            session = state.read(state.session)
        except ServiceError:
            return
        here = os.path.abspath(SERVICE_DIR)
        if any(entry.get("service_dir") == here and verdict(run_record(entry))[0] != "dead"
               for entry in session_runs(session or {}).values()):
            return
    for flag in flags:
        os.remove(flag)


if RUNS_JOBS:
    drop_stale_drain_flags()
