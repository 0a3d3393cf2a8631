"""Start a training module on every GPU of the job: plain python, torchrun, or srun + torchrun.

    python -m eagle3flow.train.launch --config-json '{"nproc": null, "nodes": 1, "device": "auto"}' \
        eagle3flow.train.trainer -- ARGS...

(LAUNCH_KEYS of the config's train section; the schema gives what is left out)

* processes per node: ``nproc`` N, or null = the CUDA devices visible at run
  time (``CUDA_VISIBLE_DEVICES`` / SLURM's allocation), 1 when there are none or the
  device is ``cpu`` (``nproc: 2, device: cpu`` runs 2 gloo processes, as CI does);
* one process on one node: ``python -m MODULE`` (no torchrun start-up cost);
* one node: ``torchrun --standalone`` (a free local port, no rendezvous server);
* several nodes (SLURM only): ``srun`` starts one torchrun per node of the allocation,
  which meet at a c10d rendezvous on the allocation's first host, keyed by the job id.
  Every node must see the same ``cache/`` (checkpoints are written by rank 0 and read
  by all ranks on resume): a shared file system, as Snakemake on SLURM assumes anyway.

The command replaces this process (``exec``), so signals and the exit status are the
module's (torchrun forwards them to its workers).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

from eagle3flow.config import cli_settings

RDZV_PORT = 29517
# The keys of the train section that say how the trainer is started (the trainer takes them too).
LAUNCH_KEYS = ("nproc", "nodes", "device")
TRAINER = "eagle3flow.train.trainer"
DFLASH_TRAINER = "eagle3flow.train.dflash_train"


def trainer_command(train: dict, python: str = "python", module: str = TRAINER) -> list[str]:
    """The command that starts a trainer (the EAGLE-3 one, or ``module``) on every GPU of the
    job as the config's train section says (nproc, nodes, device); the trainer's own
    arguments follow it. The one launch line of train_draft and of each streaming link
    (rules/common.smk trainer_launch)."""
    launch = {key: train[key] for key in LAUNCH_KEYS}
    return [python, "-m", "eagle3flow.train.launch", "--config-json", json.dumps(launch, sort_keys=True),
            module, "--"]


def visible_cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def processes_per_node(nproc: int | None, device: str) -> int:
    if nproc is not None:
        if int(nproc) < 1:
            raise ValueError(f"train.nproc must be >= 1 or null, got {nproc}")
        return int(nproc)
    if device == "cpu":
        return 1
    return max(1, visible_cuda_devices())


def slurm_first_host(env) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError("train.nodes > 1 needs a SLURM allocation (SLURM_JOB_NODELIST is not set)")
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                           text=True, check=True).stdout.split()
    return hosts[0]


def command(module: str, args: list[str], nproc: int, nodes: int, env=None,
            first_host: str | None = None) -> list[str]:
    """The argv that runs ``module`` with ``args`` on ``nodes`` x ``nproc`` processes."""
    env = os.environ if env is None else env
    python = sys.executable
    if nodes == 1 and nproc == 1:
        return [python, "-m", module, *args]
    torchrun = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nodes == 1:
        return [*torchrun, "--standalone", "--nnodes", "1", "-m", module, *args]
    host = first_host or slurm_first_host(env)
    job = env.get("SLURM_JOB_ID", "eagle3flow")
    return ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            *torchrun, "--nnodes", str(nodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{host}:{RDZV_PORT}", "--rdzv-id", f"eagle3flow-{job}",
            "-m", module, *args]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config-json", default="{}",
                        help=f"of the train section, {', '.join(LAUNCH_KEYS)}: processes per node (null: one "
                             "per visible GPU), nodes (> 1: a SLURM allocation, srun), the device")
    parser.add_argument("module", help="the python module to run, e.g. eagle3flow.train.trainer")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    ns = parser.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    settings = cli_settings(parser, "train", ns.config_json)
    unknown = sorted(set(json.loads(ns.config_json)) - set(LAUNCH_KEYS))
    if unknown:
        parser.error(f"--config-json: the launcher takes {', '.join(LAUNCH_KEYS)} of train, not {unknown}")
    nproc = processes_per_node(settings["nproc"], settings["device"])
    argv_out = command(ns.module, args, nproc, settings["nodes"])
    print(f"launch: {nproc} process(es) per node x {settings['nodes']} node(s): {shlex.join(argv_out)}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execvp(argv_out[0], argv_out)


if __name__ == "__main__":
    main()
