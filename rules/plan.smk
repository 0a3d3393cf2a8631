# The plan (eagle3flow/ops/plan/): the disk budget is checked when the workflow is read
# (rules/common.smk, dry runs too), before any job runs and so before any model loads.
# onstart prints the plan with what Snakemake's DAG will run, checks the budget again
# against it and starts a sampler of results/ + cache/ sizes; onsuccess/onerror print
# projected vs actual. `python -m eagle3flow.ops.plan --profile P` prints the plan dry.
from collections import Counter
from pathlib import Path

from snakemake.exceptions import WorkflowError

from eagle3flow.atomic import write_json
from eagle3flow.ops import plan as plan_lib

PLAN_DIR = LAYOUT.plan_dir
PLAN_STATE = {}


def start_plan():
    """onstart: the plan with the DAG's jobs, refused if over budget, and the disk sampler."""
    will_run = Counter(job.rule.name for job in workflow.dag.needrun_jobs())
    plan, refusal = plan_lib.try_project(config, os.getcwd(), dict(will_run), probe_disk=True)
    if plan is not None:
        print(plan_lib.render(plan), flush=True)
        write_json(Path(PLAN_DIR) / "plan.json", plan.to_json())
    if refusal:
        raise WorkflowError(refusal)
    if plan is None:
        return
    peak_file = Path(PLAN_DIR) / "disk_peak.json"
    peak_file.unlink(missing_ok=True)
    PLAN_STATE.update(plan=plan, peak_file=peak_file, sampler=plan_lib.start_sampler(
        [LAYOUT.results, LAYOUT.cache], peak_file, os.getpid(), config["storage"]["sample_interval_s"],
        Path(LOGS) / "plan_disk_sampler.log"))


def finish_plan():
    """onsuccess/onerror: stop the sampler, print projected vs actual, keep the throughputs."""
    plan, sampler = PLAN_STATE.get("plan"), PLAN_STATE.get("sampler")
    if plan is None:
        return
    if sampler is not None and sampler.poll() is None:
        sampler.terminate()
        sampler.wait()
    plan_lib.record_throughputs(config, Path.cwd())
    plan = plan_lib.attach_actuals(plan, config, Path.cwd(), plan_lib.read_peak(PLAN_STATE["peak_file"]))
    write_json(PLAN_STATE["peak_file"], {"peak_bytes": plan.actual_peak_bytes,
                                                   "projected_peak_bytes": plan.peak_bytes})
    write_json(Path(PLAN_DIR) / "actual.json", plan.to_json())
    print(flush=True)
    print(plan_lib.render(plan, actual=True), flush=True)
