# Helpers of rules/drain.smk, included before the GPU stages that use them.
# Frees the GPUs for the GPU stages on a box whose vLLM systemd unit holds them all,
# and brings the unit back (eagle3flow/service.py; what it does: docs/service.md).
#
# One drain job per GPU stage (a temp() flag the stage takes as input): Snakemake
# schedules it only when that stage has to run, after the stage's other inputs
# exist, so production stays up while the CPU stages before it run. The stage's
# EXIT trap restores the unit after the last GPU stage of the run (or a failed
# one); onsuccess/onerror and a detached watchdog restore it in every other case.
import glob
import sys

from eagle3flow.service import DRAINED_STAGES

DRAIN = config["drain"]
SERVICE_DIR = f"{RESULTS}/service"


def drain_flag(stage):
    """The input that makes a GPU stage wait for the drain; nothing when draining is off."""
    return f"{SERVICE_DIR}/drained_for_{stage}.flag" if DRAIN["enabled"] else []


def gpu_stage_prelude(stage, log):
    """Shell put in front of a GPU stage's command.

    The stage sees GPUs 0..N-1 numbered as nvidia-smi numbers them (the ones the
    drain freed); under SLURM the devices it allocated are kept. With draining on,
    the stage refuses to start on a service that is not drained, and its EXIT trap
    (success or failure, keeping the stage's exit status) hands the GPUs back.
    """
    shell = ""
    if GPUS > 0:
        devices = ",".join(str(i) for i in range(GPUS))
        shell += ('export CUDA_DEVICE_ORDER=PCI_BUS_ID; [ -n "${SLURM_JOB_ID:-}" ] || '
                  f"export CUDA_VISIBLE_DEVICES={devices}; ")
    if DRAIN["enabled"]:
        shell += (
            f"test -f {SERVICE_DIR}/session.json || {{ echo 'the service is not drained "
            f"({SERVICE_DIR}/session.json missing): rerun the workflow' >&2; exit 1; }}; "
            f"trap 'rc=$?; python -m eagle3flow.service stage-ended --state-dir {SERVICE_DIR}"
            f" --stage {stage} --exit-code $rc 2>&1 | tee -a {log} || true; exit $rc' EXIT; ")
    return shell


def drained_stage_inputs(wildcards):
    """The drain waits for the same inputs as its stage (not the flag itself)."""
    return {"extract_hidden_states": EXTRACT_INPUTS, "train_draft": TRAIN_INPUTS,
            "evaluate_draft": EVALUATE_INPUTS, **STREAMING_DRAIN_INPUTS}[wildcards.stage]


def write_drain_plan():
    """onstart: record which drained stages this run will run, so that a stage's
    EXIT trap knows whether the GPUs are needed again or the unit can come back."""
    from eagle3flow.service import write_plan

    # One entry per job: streaming alternates extraction and training jobs.
    stages = [job.rule.name for job in workflow.dag.needrun_jobs() if job.rule.name in DRAINED_STAGES]
    write_plan(SERVICE_DIR, sorted(stages), os.getpid())


def restore_service(reason):
    """onsuccess/onerror: bring the unit back if this run left it drained."""
    from eagle3flow.service import ServiceError, restore_if_drained

    for flag in glob.glob(f"{SERVICE_DIR}/drained_for_*.flag"):
        os.remove(flag)
    if not DRAIN["enabled"]:
        return
    try:
        restore_if_drained(DRAIN, SERVICE_DIR, reason)
    except ServiceError as error:
        print(f"\n!!! {error}", file=sys.stderr)


def print_downtime():
    """The run's drain/restore cycles, for the summary at the end of the run."""
    from eagle3flow.service import run_summary

    if not DRAIN["enabled"]:
        return
    summary = run_summary(SERVICE_DIR, os.getpid())
    if summary:
        print(f"\n=== service downtime ({SERVICE_DIR}/downtime.json) ===\n{summary}")


# A drain flag is only true while its run holds the unit drained: one left behind by
# a killed run must not let a GPU stage start on a running service.
if workflow.is_main_process:
    for _flag in glob.glob(f"{SERVICE_DIR}/drained_for_*.flag"):
        os.remove(_flag)
