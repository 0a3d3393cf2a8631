"""The b200-slurm profile on a real single-node SLURM cluster (slurmctld, slurmd,
munge from Debian; scripts/install_test_deps.sh installs them), started and torn
down here. The node declares two fake B200 GPUs (gres on character devices), so
the GPU stages' `gpu`/`gpu_model` requests are scheduled for real.

The profile is the b200-slurm one with its sizes scaled to this 2-core node and the
two settings a cluster without slurmdbd needs (squeue for status, a short first
status check); the DAG is the embedded default with a tiny config, up to the export.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from eagle3flow.serving.vllm_server import free_port
from support.workflow import BIN, REPO, workflow_copy

ETC_CONF = Path("/etc/slurm/slurm.conf")
NODE = "toy0"
FAKE_GPUS = 2


def wait_for(predicate, timeout: float, what: str, logs=()) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(
                f"--- {p}\n{Path(p).read_text()[-2000:]}" for p in logs if Path(p).exists()))
        time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the toy SLURM cluster runs its daemons as root")
    if shutil.which("slurmctld") is None:
        subprocess.run(["bash", str(REPO / "scripts" / "install_test_deps.sh")], check=True, timeout=600)
    if ETC_CONF.exists() and not ETC_CONF.is_symlink():
        pytest.skip(f"{ETC_CONF} belongs to a real cluster on this machine; not touching it")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log", "munge"):
        (root / sub).mkdir()
    # Fake GPUs must be character devices: slurmd hangs the job on plain files.
    for index in range(FAKE_GPUS):
        os.mknod(root / f"nvidia{index}", 0o666 | 0o020000, os.makedev(1, 3))
    key = root / "munge" / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
    socket_path = root / "munge" / "munge.sock"
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=toy
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=500
GresTypes=gpu
ReturnToService=2
MinJobAge=600
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
NodeName={NODE} NodeAddr=127.0.0.1 CPUs=2 RealMemory=4000 Gres=gpu:b200:{FAKE_GPUS} State=UNKNOWN
PartitionName=cpu Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes={NODE} MaxTime=INFINITE State=UP
""")
    (root / "gres.conf").write_text(
        f"NodeName={NODE} Name=gpu Type=b200 File={root}/nvidia[0-{FAKE_GPUS - 1}]\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    # srun inside a job does not see SLURM_CONF: the default path must lead here too.
    ETC_CONF.parent.mkdir(parents=True, exist_ok=True)
    if ETC_CONF.is_symlink():
        ETC_CONF.unlink()
    ETC_CONF.symlink_to(conf)
    daemons = []
    try:
        daemons.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
             f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/seed",
             f"--log-file={root}/log/munged.log"], env=env))
        wait_for(socket_path.exists, 20, "munged", [root / "log" / "munged.log"])
        daemons.append(subprocess.Popen(["slurmctld", "-D", "-f", str(conf)], env=env))
        daemons.append(subprocess.Popen(["slurmd", "-D", "-N", NODE, "-f", str(conf)], env=env))

        def node_idle() -> bool:
            result = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
            return result.stdout.strip().startswith("idle")

        wait_for(node_idle, 60, "the node to be idle", [root / "log" / "slurmctld.log", root / "log" / "slurmd.log"])
        yield {"env": env, "root": root}
    finally:
        subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env=env, capture_output=True)
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if ETC_CONF.is_symlink() and os.readlink(ETC_CONF) == str(conf):
            ETC_CONF.unlink()


def toy_profile(workdir: Path) -> Path:
    """profiles/b200-slurm scaled to the toy node, plus the no-slurmdbd settings."""
    profile = yaml.safe_load((REPO / "profiles" / "b200-slurm" / "config.yaml").read_text())
    profile["jobs"] = 2
    profile["default-resources"].update(mem_mb=500, cpus_per_task=1, runtime=30)
    for resources in profile["set-resources"].values():
        for key, value in {"gpu": FAKE_GPUS, "mem_mb": 1000, "cpus_per_task": 1, "runtime": 30}.items():
            if key in resources:
                resources[key] = value
    profile["slurm-status-command"] = "squeue"
    # the plugin then waits 10 s longer after each check that finds nothing finished
    profile["slurm-init-seconds-before-status-checks"] = 1
    profile["latency-wait"] = 5
    out = workdir / "profiles" / "toy-slurm"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(profile))
    return out


@pytest.mark.slow
def test_embedded_dag_runs_through_the_slurm_profile(slurm_cluster, tmp_path):
    workdir = workflow_copy(tmp_path / "wf")
    profile = toy_profile(workdir)
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({
        "embedded": {"train_steps": 1, "max_conversations": 60},
        "dataset": {"max_length": 128},
        "vocab": {"draft_vocab_size": 128},
        "train": {"epochs": 1, "batch_tokens": 1024, "checkpoint_every": 1000, "eval_max_tokens": 256},
        "resources": {"gpus": FAKE_GPUS}}))
    env = {**slurm_cluster["env"], "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [str(BIN / "snakemake"), "results/draft/config.json", "results/draft/model.safetensors",
         "--profile", str(profile), "--verbose", "--configfile", "profiles/b200-slurm/workflow.yaml", str(tiny)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=420)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert (workdir / "results" / "draft" / "model.safetensors").exists()
    # Every job went through sbatch; the GPU stages asked for the node's fake B200s
    # on the gpu partition, the CPU ones for the cpu partition.
    submitted = [line for line in output.splitlines() if "sbatch call:" in line]
    for rule in ("extract_hidden_states", "train_draft"):
        [call] = [c for c in submitted if f"rule_{rule}" in c]
        assert f"--gpus=b200:{FAKE_GPUS}" in call and "-p gpu" in call and "--exclusive" in call, call
        assert "--ntasks-per-gpu" not in call
    cpu_calls = [c for c in submitted if "rule_prepare_dataset" in c]
    assert cpu_calls and all("-p cpu" in c and "--gpus" not in c for c in cpu_calls), cpu_calls
    # every job carries the rule's own memory, not Snakemake's default
    assert len(submitted) == 6 and all(" --mem 1000" in c for c in submitted), submitted
    # The shared-venv set-up (README, Profiles): every job runs the venv's interpreter
    # (the one running Snakemake here) with the submitting shell's PATH.
    for call in submitted:
        wrapped = re.search(r'--wrap="(?:.* )?(\S+) -m snakemake ', call)
        assert wrapped and Path(wrapped.group(1)).parent == BIN, call
        assert " --export=ALL " in call, call
