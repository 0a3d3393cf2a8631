"""Training under torchrun: 2 gloo processes on the CPU, killed and resumed bitwise, and the
same global batches (and so nearly the same losses) as one process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3flow.train.launch import command, processes_per_node, trainer_command
from eagle3flow.train.config import TRAIN_DEFAULTS
from eagle3flow.train.trainer import train
from eagle3flow.train.data import rank_share
from support.builders import TRAIN_CONFIG, losses, make_hidden_states, make_vocab_map

REPO = Path(__file__).resolve().parent.parent
DIST_CONFIG = {**TRAIN_CONFIG, "epochs": 3, "checkpoint_every": 2, "nproc": 2}


@pytest.fixture(scope="module")
def inputs(random_llama_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_inputs")
    train_m = make_hidden_states(random_llama_target, root / "hs_train", 16, seed=2, samples_per_shard=6)
    vmap = make_vocab_map(train_m, 512, 200, root / "vocab_map.safetensors")
    return {"train": train_m, "vocab": vmap, "target": random_llama_target}


def launch(inputs, out, cache, config, env_extra=None, wait=True):
    """The train rule's command line: eagle3flow.train.launch -> torchrun -> eagle3flow.train.trainer."""
    cmd = [*trainer_command({**TRAIN_DEFAULTS, "device": "cpu", **config}, sys.executable),
           "--train-manifest", str(inputs["train"]),
           "--vocab-map", str(inputs["vocab"]), "--target", str(inputs["target"]),
           "--out-dir", str(out), "--cache-root", str(cache), "--config-json", json.dumps(config)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    if wait:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        return output
    return proc


def kill_after_checkpoint(proc, cache: Path, step: int) -> None:
    """SIGKILL the launched group (torchrun and its workers) once checkpoint ``step`` exists."""
    deadline = time.monotonic() + 180
    try:
        while not any(int(p.name[5:]) >= step for p in cache.glob("*/step-*")):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.4)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torchrun_on_every_gpu_resumes_within_bf16_noise(inputs, tmp_path):
    """The train rule's launch with ``nproc: null`` (auto) on a GPU machine: one NCCL process per
    visible GPU, bf16 autocast; killed after a checkpoint and resumed, the losses match an
    uninterrupted run within bf16 noise (flash attention's backward sums in any order)."""
    config = {**DIST_CONFIG, "nproc": None, "device": "cuda"}     # the rule's default: auto
    gpus = torch.cuda.device_count()
    output = launch(inputs, tmp_path / "ref_out", tmp_path / "ref_cache", config)
    assert f"{gpus} process(es) on cuda" in output
    reference = losses(tmp_path / "ref_out")
    kill_after_checkpoint(launch(inputs, tmp_path / "out", tmp_path / "cache", config,
                                 {"EAGLE3FLOW_TEST_STEP_DELAY": "0.5"}, wait=False), tmp_path / "cache", 4)
    assert 4 <= len(losses(tmp_path / "out")) < len(reference)
    assert "resuming from" in launch(inputs, tmp_path / "out", tmp_path / "cache", config)
    resumed = losses(tmp_path / "out")
    assert [r[0] for r in resumed] == [r[0] for r in reference]
    for (_, loss1, steps1, _), (_, loss2, steps2, _) in zip(resumed, reference):
        assert loss1 == pytest.approx(loss2, rel=2e-2)
        assert steps1 == pytest.approx(steps2, rel=5e-2, abs=1e-3)


@pytest.mark.slow   # three torchrun launches of 2 processes: ~35 s on 2 idle cores
def test_torchrun_two_processes_resume_bitwise_and_match_one_process(inputs, tmp_path):
    output = launch(inputs, tmp_path / "ref_out", tmp_path / "ref_cache", DIST_CONFIG)
    assert "2 process(es) on cpu" in output and "torch.distributed.run" in output
    reference = losses(tmp_path / "ref_out")
    assert len(reference) >= 8
    rows = [json.loads(l) for l in (tmp_path / "ref_out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(reference) and all(r["world_size"] == 2 for r in rows)
    # The data wait is measured (data_workers 0: each rank reads its share in the loop) and
    # is a mean per rank and step: more than nothing, less than the step's own wall time.
    assert all(0 < r["data_wait_s"] < r["tokens"] / r["tokens_per_s"] for r in rows), \
        [(r["data_wait_s"], r["tokens"] / r["tokens_per_s"]) for r in rows]
    # An MFU is a fraction of a stated peak, never above 1 (None when the peak was measured low).
    assert all(r["mfu_peak_flops"] > 0 and r["mfu_basis"] == "measured matmul" for r in rows)
    assert all(r["mfu"] is None or 0 < r["mfu"] <= 1 for r in rows), [r["mfu"] for r in rows]

    # Killed (torchrun and both workers) between checkpoints, then resumed: bitwise the same.
    kill_after_checkpoint(launch(inputs, tmp_path / "out", tmp_path / "cache", DIST_CONFIG,
                                 {"EAGLE3FLOW_TEST_STEP_DELAY": "0.3"}, wait=False), tmp_path / "cache", 4)
    partial = losses(tmp_path / "out")
    assert 4 <= len(partial) < len(reference)
    time.sleep(1.0)     # torchrun's workers (own sessions) died with it: nothing more is logged
    assert losses(tmp_path / "out") == partial
    # the resumed run reads its batches in a worker process: same data, same losses
    output = launch(inputs, tmp_path / "out", tmp_path / "cache", {**DIST_CONFIG, "data_workers": 1})
    assert "resuming from" in output
    assert losses(tmp_path / "out") == reference

    # One process trains on the same global batches: the same losses up to summation order.
    single = train(inputs["train"], None, inputs["vocab"], inputs["target"], tmp_path / "one_out",
                   tmp_path / "one_cache", {**DIST_CONFIG, "nproc": 1})
    assert single["world_size"] == 1
    one = losses(tmp_path / "one_out")
    assert [r[0] for r in one] == [r[0] for r in reference]
    for (_, loss1, steps1, acc1), (_, loss2, steps2, acc2) in zip(one, reference):
        assert loss1 == pytest.approx(loss2, rel=1e-4) and steps1 == pytest.approx(steps2, rel=1e-4)
        assert acc1 == pytest.approx(acc2, abs=0.02)


SUM_GRADIENTS = r"""
import sys
import torch
from eagle3flow.train.distributed import init_distributed, sum_gradients
import eagle3flow.train.distributed as d
d.BUCKET_BYTES = 64                        # several buckets
ctx = init_distributed("cpu")
params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 40, 7)]
def grads(rank):                           # the last parameter gets no gradient on any rank
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(p.numel(), generator=g) * 1e3 + 0.123456 for p in params[:2]]
for p, grad in zip(params, grads(ctx.rank)):
    p.grad = grad
want = [a + b for a, b in zip(grads(0), grads(1))]
sum_gradients(params, ctx, torch.bfloat16 if sys.argv[1] == "bf16" else None)
for p, w in zip(params[:2], want):
    assert p.grad.dtype == torch.float32
    if sys.argv[1] == "bf16":              # summed in bf16: 8 bits of the ~1e3 inputs' mantissa
        assert torch.allclose(p.grad, w, rtol=0, atol=2 * 2 ** -8 * 4e3), (p.grad, w)
        assert not torch.equal(p.grad, w)
    else:
        assert torch.equal(p.grad, w)
assert torch.equal(params[2].grad, torch.zeros(7))
ctx.close()
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sum_gradients_over_two_gloo_ranks(dtype, tmp_path):
    script = tmp_path / "sum.py"
    script.write_text(SUM_GRADIENTS)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             "2", str(script), dtype], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


SHARDED_MUON = r"""
import os, pathlib
import torch
from eagle3flow.train import optim
from eagle3flow.train.distributed import init_distributed
ctx = init_distributed("cpu")
shapes = [(48, 16), (16, 48), (32, 32), (8, 64), (64, 8)]
calls = []
orthogonalize = optim.orthogonalize
def counted(matrix, *args):
    calls.append(tuple(matrix.shape))
    return orthogonalize(matrix, *args)
optim.orthogonalize = counted
optim.BROADCAST_WINDOW_BYTES = 4096     # a few updates in flight, the oldest waited for and applied
def three_steps(shard):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    opt = optim.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw",
                     shard=shard)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)     # the summed gradients: alike on every rank
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt
sharded, opt = three_steps((ctx.rank, ctx.world_size))
mine = len(calls)
calls.clear()
alone, alone_opt = three_steps(None)
assert len(calls) == 3 * len(shapes)
assert mine == 3 * sum(owner == ctx.rank for owner in opt.owners.values()) and 0 < mine < len(calls), mine
for a, b in zip(sharded, alone):
    assert torch.equal(a, b)
assert torch.equal(opt.state[sharded[0]]["momentum_buffer"], alone_opt.state[alone[0]]["momentum_buffer"])
pathlib.Path(os.environ["SHARES_DIR"], f"rank{ctx.rank}").write_text(str(mine))
ctx.close()
"""


def test_muon_shares_newton_schulz_over_two_gloo_ranks_bitwise(tmp_path):
    """Each matrix orthogonalised on one rank, the update broadcast: every rank's weights
    equal one process's after three steps, bit for bit, each rank having run only its share."""
    script = tmp_path / "muon.py"
    script.write_text(SHARDED_MUON)
    # each rank writes its share to a file of its own: two ranks' lines on one captured stdout
    # were seen to lose one of them
    shares_dir = tmp_path / "shares"
    shares_dir.mkdir()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             "2", str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                 "SHARES_DIR": str(shares_dir)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shares = {path.name: int(path.read_text()) for path in shares_dir.iterdir()}
    assert sorted(shares) == ["rank0", "rank1"] and sum(shares.values()) == 3 * 5, (shares, result.stderr[-3000:])


def test_muon_owners_balance_the_products_and_follow_from_the_shapes():
    from eagle3flow.train.optim import muon_owners

    shapes = [torch.Size(s) for s in [(4096, 12288), (6144, 8192), (4096, 4096), (28672, 4096), (4096, 14336)]]
    assert muon_owners(shapes, 1) == [0] * 5
    owners = muon_owners(shapes, 2)
    assert owners == muon_owners(list(shapes), 2) and set(owners) == {0, 1}
    # the largest goes first, to rank 0; on 8 ranks every matrix has a rank of its own
    assert owners[3] == 0 and len(set(muon_owners(shapes, 8))) == 5
    # the step waits for the busiest rank: all of it on one, the largest matrix's on 8
    from eagle3flow.model.optimizer_flops import busiest_rank_flops_per_step, newton_schulz_flops

    class Draft:
        def hidden_matrix_shapes(self):
            return [tuple(s) for s in shapes]
    total = newton_schulz_flops(Draft().hidden_matrix_shapes())
    assert busiest_rank_flops_per_step(Draft(), "muon", 1) == total
    assert busiest_rank_flops_per_step(Draft(), "muon", 8) == newton_schulz_flops([shapes[3]])
    assert total / 2 <= busiest_rank_flops_per_step(Draft(), "muon", 2) < total
    assert busiest_rank_flops_per_step(Draft(), "adamw", 8) == 0


def test_rank_shares_cover_the_batch_once():
    lengths = [[30, 10, 20], [40, 5]]
    batch = [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]
    for world in (1, 2, 3, 8):
        shares = [rank_share(batch, lengths, r, world) for r in range(world)]
        assert sorted(x for s in shares for x in s) == sorted(batch)
        for share in shares:   # each keeps the batch's order
            assert share == sorted(share, key=batch.index)
    # token-balanced: 40 | 30+5 | 20+10
    assert [sum(lengths[s][i] for s, i in rank_share(batch, lengths, r, 3)) for r in range(3)] == [40, 35, 30]


def test_launch_commands():
    assert command("eagle3flow.train.trainer", ["--x"], 1, 1)[1:] == ["-m", "eagle3flow.train.trainer", "--x"]
    single_node = command("eagle3flow.train.trainer", ["--x"], 8, 1)
    assert single_node[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in single_node
    assert single_node[single_node.index("--nproc-per-node") + 1] == "8"
    multi = command("eagle3flow.train.trainer", ["--x"], 8, 4, env={"SLURM_JOB_ID": "77"}, first_host="gpu-a01")
    assert multi[:2] == ["srun", "--nodes=4"] and "--ntasks-per-node=1" in multi
    assert multi[multi.index("--rdzv-endpoint") + 1].startswith("gpu-a01:")
    assert multi[multi.index("--nnodes") + 1] == "4" and multi[-2:] == ["eagle3flow.train.trainer", "--x"][-2:]
    assert processes_per_node(None, "cpu") == 1 and processes_per_node(3, "cpu") == 3
