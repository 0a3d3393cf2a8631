"""Shared fixtures: small random targets made offline, in seconds; the embedded default
build; the drain tests' workflow with its CPU stages done. Builders are in tests/support/."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

# `make test` runs two pytest-xdist workers on a 2-core machine. Each worker gets a core
# of its own (its subprocesses inherit it) and one thread per process, torch's and
# vLLM's: two processes of two threads each on two cores wait on each other's
# descheduled threads (the embedded build, two at once: 7x slower; pinned, 1.45x faster
# than one after the other). Set before torch loads (the support modules import it).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(WORKER.removeprefix("gw")) % len(cores)]
    os.sched_setaffinity(0, {core})
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)

from support import fault_rows
from support.box import FakeBox, run_snakemake, snakemake_args, tiny_config
from support.targets import make_random_llama
from support.workflow import workflow_copy

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
# Where tests write what they report beside pass/fail (the fault matrix's table): a
# folder of this run, never the checkout. Set here, before xdist starts its workers, so
# that they all inherit one; EAGLE3FLOW_TEST_REPORTS=tests rewrites the committed tables.
REPORTS = Path(os.environ.setdefault("EAGLE3FLOW_TEST_REPORTS",
                                     tempfile.mkdtemp(prefix="eagle3flow-test-reports-"))).resolve()
# The fault matrix's rows, one file each, from whichever worker's test drove the fault
# (tests/support/fault_rows.py): a folder of this session only, never the reports folder
# (that may be the checkout's tests/). The controller assembles them at the end.
os.environ.setdefault(fault_rows.ROWS_ENV, tempfile.mkdtemp(prefix="eagle3flow-fault-rows-"))
SESSION_START = pytest.StashKey[float]()
# Each test group's seconds, every phase summed (on the controller: every worker's reports).
GROUP_SECONDS: dict[str, float] = defaultdict(float)


@pytest.fixture(scope="session")
def random_llama_target(tmp_path_factory) -> Path:
    """A random 8-layer LlamaForCausalLM (H=64, head_dim 32, vocab 512) saved as an HF dir (no tokenizer)."""
    return make_random_llama(tmp_path_factory.mktemp("random_llama"))


# The embedded default build is the longest group's first step, and a worker running it
# is pinned to one core. Under xdist the controller starts it when the session begins, on
# one thread and unpinned, so it runs beside both workers (their tests leave about a third
# of the cores idle: servers starting, stages waiting on kills) instead of before the
# embedded group's tests; the group's first test waits for it.
BUILD_ENV = "EAGLE3FLOW_TEST_EMBEDDED_BUILD"
BUILD_PROCESS_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
BUILD_PROCESS = pytest.StashKey[subprocess.Popen]()


def build_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "eagle3flow.embedded.build", "--out-dir", str(out)]


def wants_shared_build(args: list[str]) -> bool:
    """Whether the command line selects a test of the shared build (by path; -k may still
    deselect them: the build is then stopped at the session's end)."""
    for arg in args:
        path, _, test = arg.partition("::")
        path = Path(path)
        if path.is_dir():
            if any(path.rglob("test_embedded.py")):
                return True
        elif path.name in ("test_embedded.py", "test_streaming.py"):
            return True
        elif path.name == "test_workflow.py" and (not test or test.startswith("test_embedded_default")):
            return True
    return False


def pytest_configure(config):
    if (os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("EAGLE3FLOW_EMBEDDED_DIR")
            or not getattr(config.option, "numprocesses", None) or config.option.collectonly
            or not wants_shared_build(config.args)):
        return
    root = Path(tempfile.mkdtemp(prefix="eagle3flow-embedded-build-"))
    # the exit status lands in a file the workers can read: only the controller holds the process
    wrapped = ["bash", "-c", '"$@" > "$0/build.log" 2>&1; echo $? > "$0/exit_status"', str(root),
               *build_command(root / "build"), "--threads", "1"]
    config.stash[BUILD_PROCESS] = subprocess.Popen(wrapped, cwd=REPO, env=BUILD_PROCESS_ENV, start_new_session=True)
    os.environ[BUILD_ENV] = str(root)


def wait_for_build(root: Path, timeout_s: float = 2400) -> Path:
    status = root / "exit_status"
    until = time.monotonic() + timeout_s
    while not status.exists() or not status.read_text().strip():
        if time.monotonic() > until:
            pytest.fail(f"the embedded build ({root}) did not finish within {timeout_s:.0f} s")
        time.sleep(1)
    log = (root / "build.log").read_text(errors="replace")
    assert status.read_text().strip() == "0", f"embedded build failed:\n{log[-4000:]}"
    return root / "build"


@pytest.fixture(scope="session")
def embedded_default_build(tmp_path_factory) -> Path:
    """The embedded default build (``python -m eagle3flow.embedded.build``: target/,
    conversations.jsonl, build_stats.json; minutes), made once per session and shared:
    copy from it, never write into it. EAGLE3FLOW_EMBEDDED_DIR reuses an existing one;
    under xdist the controller has started it with the session (pytest_configure)."""
    existing = os.environ.get("EAGLE3FLOW_EMBEDDED_DIR")
    if existing:
        return Path(existing)
    started = os.environ.get(BUILD_ENV)
    if started:
        return wait_for_build(Path(started))
    out = tmp_path_factory.mktemp("embedded_default")
    result = subprocess.run(build_command(out), cwd=REPO, env=BUILD_PROCESS_ENV, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, f"embedded build failed:\n{result.stderr[-4000:]}"
    return out


@pytest.fixture(scope="session")
def embedded_workflow(embedded_default_build, tmp_path_factory) -> dict:
    """The embedded workflow at CI's size, killed twice and rerun to the end (minutes),
    made once per session and shared by the end-to-end test and the streaming tests
    (support/workflow.py run_embedded_with_kills): copy from its workdir, or add to it
    only what no other test reads."""
    from support.workflow import run_embedded_with_kills

    return run_embedded_with_kills(embedded_default_build, tmp_path_factory.mktemp("embedded_workflow"))


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Path:
    """The drain tests' (test_drain, test_fault_matrix) workflow copy with the CPU stages
    before extraction done (drain on). Running them never touches the service: no GPU
    stage had to run."""
    root = tmp_path_factory.mktemp("upstream")
    box = FakeBox(root / "box")
    workdir = workflow_copy(root / "wf")
    config = tiny_config(box, root / "tiny.json")
    result = run_snakemake(box, workdir, "results/dataset/train.parquet",
                           "results/vocab/vocab_map.safetensors", *snakemake_args(workdir, config))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (box.systemd / "calls.log").exists(), "a CPU-only run touched the service"
    return workdir


# Under xdist (--dist loadgroup) each module is one group, so its module fixtures are
# built once; the tests of the embedded default build share one group, so that build
# (minutes) is made once; the real-target test and the Kimi-K2.5 one (five vLLM starts,
# the unit's own among them) are groups of their own. `make test` hands
# the groups out in the order sorted here (--no-loadscope-reorder): the longest ones
# first, so that no long group starts late and ends the run alone, then the rest by
# their number of tests.
SHARED_BUILD = "embedded_default_build"
SHARED_BUILD_TESTS = {"test_embedded.py", "test_streaming.py",
                      "test_workflow.py::test_embedded_default_end_to_end_with_kills",
                      "test_workflow.py::test_embedded_default_with_a_dflash_draft_end_to_end"}
# The shared build's group goes third: the controller builds its target meanwhile
# (pytest_configure), so no worker waits for the build. The Kimi-K2.5 test, fourth: with
# its module's few tests it would be handed out among the last and end the run alone.
LONGEST_FIRST = ("test_workflow.py::test_real_target_end_to_end", "test_fault_matrix.py", SHARED_BUILD,
                 "test_workflow.py::test_kimi_k25_layout_end_to_end_on_the_production_box")


def xdist_group(item) -> str:
    return group_of(item.path.name, item.originalname)


def group_of(module: str, test: str) -> str:
    """A test's group (``test``: its function's name, without parameters)."""
    test = f"{module}::{test}"
    if test in SHARED_BUILD_TESTS or module in SHARED_BUILD_TESTS:
        return SHARED_BUILD
    return test if test in LONGEST_FIRST else module


@pytest.hookimpl(tryfirst=True)   # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
    size = Counter(xdist_group(item) for item in items)
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    # stable: a group's tests keep their order
    items.sort(key=lambda item: (rank.get(xdist_group(item), len(rank)), -size[xdist_group(item)]))


# The suite's budget: `make test` sets EAGLE3FLOW_TEST_BUDGET_S (CI's, with the set-up)
# and EAGLE3FLOW_TEST_WORKERS; the summary shows each group's time against it. A group
# runs on one worker, so one group over 1/workers of the whole run's worker-seconds sets
# the run's wall clock alone: a full run (the budget set) fails, naming the group, when
# one takes more than MAX_GROUP_SHARE of them, so that growth is split or shared before
# CI runs out. Shares, not seconds: a slower host moves every group alike. Nothing is
# timed inside a test.
MAX_GROUP_SHARE = 0.5


def pytest_sessionstart(session):
    session.config.stash[SESSION_START] = time.time()


def pytest_runtest_logreport(report):
    """Every phase's time (a module fixture's set-up counts to the test that made it),
    summed per group; under xdist the controller sees every worker's reports."""
    # under --dist loadgroup xdist appends "@<group>" to the node id
    path, _, rest = report.nodeid.split("@", 1)[0].partition("::")
    GROUP_SECONDS[group_of(Path(path).name, rest.split("[", 1)[0].split("::")[-1])] += report.duration


def budget_findings(seconds: dict[str, float]) -> tuple[list[str], list[str]]:
    """(lines of the table of groups, groups over their share of the run's worker-seconds)."""
    budget_s = float(os.environ.get("EAGLE3FLOW_TEST_BUDGET_S", 0))
    workers = int(os.environ.get("EAGLE3FLOW_TEST_WORKERS", 1))
    total = sum(seconds.values()) or 1.0
    lines, over = [], []
    for group, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        budget = f", {s / (budget_s * workers):5.1%} of the budget's {budget_s * workers:.0f}" if budget_s else ""
        lines.append(f"{s:8.1f} s  {s / total:5.1%} of this run{budget}  {group}")
        if budget_s and len(seconds) > 1 and s > MAX_GROUP_SHARE * total:
            over.append(f"!!! test group {group} took {s:.0f} s, {s / total:.0%} of the run's {total:.0f} worker-s "
                        f"(at most {MAX_GROUP_SHARE:.0%}): on {workers} workers it alone sets the wall clock; "
                        "share its expensive work with another test or split it")
    return lines, over


def pytest_terminal_summary(terminalreporter, config):
    """CI's log shows each group's time against the budget, and the fault matrix when a
    test of this run recorded a row of it (assembled by pytest_sessionfinish, which runs
    before this summary)."""
    lines, over = budget_findings(GROUP_SECONDS)
    if lines:
        terminalreporter.write_sep("=", "time per test group (every phase, summed over workers)")
        for line in lines + over:
            terminalreporter.write_line(line)
    matrix = REPORTS / "fault_matrix.md"
    start = config.stash.get(SESSION_START, None)
    if start is not None and matrix.is_file() and matrix.stat().st_mtime >= start:
        terminalreporter.write_sep("=", f"fault matrix ({matrix})")
        terminalreporter.write_line(matrix.read_text())


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # Every worker has ended: the rows of all of them are on disk.
    fault_rows.assemble(REPORTS, Path(__file__).with_name("fault_matrix.json"))
    build = session.config.stash.get(BUILD_PROCESS, None)
    if build is not None and build.poll() is None:   # no test waited for it (deselected, or failed early)
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
    _, over = budget_findings(GROUP_SECONDS)
    if over and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
