"""Hidden-state extraction: the layer-id convention, exactness, resume after kill -9, cache."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from eagle3flow.extract import extraction, hf as hidden_states, shards
from eagle3flow.extract import __main__ as extract_cli
from eagle3flow.extract.extraction import LOADING_LINE
from eagle3flow.extract.hf import capture, extract
from eagle3flow.extract.shard_plan import partition_manifest_name
from eagle3flow.extract.shards import main as shards_main
from eagle3flow.target.identity import target_digest, target_identity
from support.builders import write_dataset
from support.fault_rows import record, yes
from support.targets import make_random_llama

AUX = [0, 2, 4, 7]  # includes the embeddings (0) and the last layer's input (N-1)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: fast on a shared 2-core box, and the same math as the subprocesses."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(random_llama_target):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(random_llama_target), dtype=torch.float32).eval()


def shard_files(cache_root: Path) -> list[Path]:
    return sorted(cache_root.glob("*/shard-*.safetensors"))


def stamps(paths) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


def digests(paths) -> dict[str, str]:
    return {p.name: shards.sha256_file(p) for p in paths}


def run_extract(dataset, target, out: Path, manifest_name: str = "manifest.json", **kwargs):
    opts = dict(aux_layer_ids=AUX, batch_tokens=96, shard_tokens=120, device="cpu")
    opts.update(kwargs)
    return extract(dataset, target, out / manifest_name, out / "cache", **opts)


def test_capture_follows_the_layer_id_convention(model):
    ids = torch.randint(3, 512, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    aux, last = capture(model, ids, mask, AUX)
    with torch.inference_mode():
        reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hidden = model.config.hidden_size
    assert aux.shape == (2, 9, len(AUX) * hidden) and last.shape == (2, 9, hidden)
    # id k = HF hidden_states[k] = the input of decoder layer k (capture hooks that input).
    for j, k in enumerate(AUX):
        assert torch.equal(aux[..., j * hidden:(j + 1) * hidden], reference.hidden_states[k]), k
    assert torch.equal(aux[..., :hidden], model.model.embed_tokens(ids))
    # last is the final-norm output: the teacher's logits, exactly.
    assert torch.equal(model.lm_head(last), reference.logits)


def test_extract_equals_per_sample_forward(tmp_path, random_llama_target, model):
    dataset = write_dataset(tmp_path / "train.parquet", 16)
    manifest = run_extract(dataset, random_llama_target, tmp_path, split_name="eval")
    table = pd.read_parquet(dataset)
    assert manifest["num_samples"] == 16 and manifest["num_tokens"] == int(table.num_tokens.sum())
    assert manifest["split"] == "eval" and manifest["aux_layer_ids"] == AUX
    assert manifest["num_layers"] == 8 and manifest["hidden_size"] == 64
    assert manifest["dtype"] == "float32" and len(manifest["shards"]) > 2
    assert manifest["num_loss_tokens"] == int(sum(m.sum() for m in table.loss_mask))
    assert manifest["shard_dir"] == str(tmp_path / "cache" / manifest["fingerprint"])
    loaded = shards.load_manifest(tmp_path / "manifest.json")
    for entry, path in zip(manifest["shards"], loaded.shard_paths):
        assert entry == shards.shard_entry(path)  # sha256, counts and bytes of the file on disk

    samples = list(loaded.iter_samples())
    assert [s["id"] for s in samples] == list(table.id)  # dataset order restored after sorting
    for sample, (_, row) in zip(samples, table.iterrows()):
        assert sample["input_ids"].tolist() == row.input_ids.tolist()
        assert sample["loss_mask"].tolist() == row.loss_mask.tolist()
        ids = torch.as_tensor(row.input_ids, dtype=torch.long)[None]
        with torch.inference_mode():
            ref = model(input_ids=ids, output_hidden_states=True)
        expected_aux = torch.cat([ref.hidden_states[k][0] for k in AUX], dim=-1)
        # Batched with padding vs alone: same math, up to float32 reduction order.
        torch.testing.assert_close(sample["aux_hidden_states"], expected_aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.lm_head(sample["last_hidden_state"]), ref.logits[0],
                                   rtol=1e-4, atol=1e-4)


def test_max_length_cuts_samples(tmp_path, random_llama_target):
    dataset = write_dataset(tmp_path / "train.parquet", 6, min_len=10, max_len=30)
    manifest = run_extract(dataset, random_llama_target, tmp_path, max_length=12)
    samples = list(shards.load_manifest(tmp_path / "manifest.json").iter_samples())
    assert all(len(s["input_ids"]) == 12 for s in samples)
    assert manifest["num_tokens"] == 72 and manifest["truncated_samples"] == 6


# The extraction CLI whose second shard's write is held after its bytes are in the
# temporary file, before it is synced and renamed: the signal lands mid-write.
HELD_IN_SECOND_SHARD_WRITE = """
import sys, time
from eagle3flow import atomic
from eagle3flow.extract.__main__ import main
fsync, shards = atomic._fsync, []
def held(path, directory=False):
    if ".safetensors.tmp-" in path.name:
        shards.append(path)
        if len(shards) == 2:
            print("writing", path, flush=True)
            time.sleep(300)
    fsync(path, directory)
atomic._fsync = held
main(sys.argv[1:])
"""


def test_killed_mid_write_then_resumed_matches_an_uninterrupted_run(tmp_path, random_llama_target):
    """SIGTERM while a shard's bytes are being written (the job signalled; Python's default
    action runs no cleanup, as SIGKILL): the rerun keeps every finished shard, removes the
    killed writer's temporary file, and ends with exactly the shards of an uninterrupted
    run."""
    dataset = write_dataset(tmp_path / "train.parquet", 30)
    reference = run_extract(dataset, random_llama_target, tmp_path / "reference")
    assert len(reference["shards"]) >= 5

    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", HELD_IN_SECOND_SHARD_WRITE, "--dataset", str(dataset),
           "--target", str(random_llama_target), "--manifest", str(out / "manifest.json"),
           "--cache-root", str(out / "cache"),
           "--config-json", json.dumps({"aux_layer_ids": AUX, "device": "cpu", "batch_tokens": 96, "shard_tokens": 120})]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    temporaries = lambda: sorted(p.name for p in (out / "cache").glob("*/.*.safetensors.tmp-*"))  # noqa: E731
    try:
        assert any(line.startswith("writing") for line in proc.stdout), "the second shard was never written"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    survivors = shard_files(out / "cache")
    left = temporaries()
    assert 1 <= len(survivors) < len(reference["shards"]) and not (out / "manifest.json").exists()
    before = stamps(survivors)

    resumed = run_extract(dataset, random_llama_target, out)
    final = shard_files(out / "cache")
    rewritten = [k for k, v in stamps(final).items() if k in before and v != before[k]]
    record(scenario="SIGTERM during a shard write (extraction)",
           fault_at=f"extraction, {len(survivors)} shard(s) finished, {len(left)} unfinished shard file(s) left",
           unit_healthy="not drained in this test (the workflow's SIGTERM and SIGKILL rows drain)", downtime="-",
           foreign_killed=0, recomputed=len(rewritten),
           consistent=f"unfinished shard files after the rerun: {len(temporaries())}",
           notes=f"the rerun's shards equal the uninterrupted run's: {yes(resumed['shards'] == reference['shards'])}")
    assert left and rewritten == []  # finished shards are not written again
    assert temporaries() == [], "the killed writer's temporary file was never removed"
    assert digests(final) == {s["file"]: s["sha256"] for s in reference["shards"]}
    assert resumed["shards"] == reference["shards"]
    assert resumed["fingerprint"] == reference["fingerprint"]


def test_corrupt_shards_are_recomputed_alone(tmp_path, random_llama_target, capfd):
    dataset = write_dataset(tmp_path / "train.parquet", 20)
    first = run_extract(dataset, random_llama_target, tmp_path)
    files = shard_files(tmp_path / "cache")
    truncated, flipped = files[1], files[3]
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size // 2)
    with open(flipped, "r+b") as f:  # same size, one byte of tensor data changed: only the sha sees it
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = stamps(files)
    capfd.readouterr()

    second = run_extract(dataset, random_llama_target, tmp_path)
    after = stamps(files)
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {truncated.name, flipped.name}
    assert second["shards"] == first["shards"]
    assert f"({len(files) - 2} cached)" in capfd.readouterr().err


def test_fully_cached_rerun_does_not_load_the_model(tmp_path, random_llama_target, capfd):
    # A private copy of the target whose weights' data we then overwrite in place with
    # zeros, keeping size, header and mtime (what the target's identity cannot see,
    # eagle3flow/target/identity.py): the same cache key, and hidden states of zeros had
    # the model been loaded.
    target = tmp_path / "target"
    shutil.copytree(random_llama_target, target)
    dataset = write_dataset(tmp_path / "train.parquet", 8)
    first = run_extract(dataset, target, tmp_path)
    assert LOADING_LINE in capfd.readouterr().err

    weights = target / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(data_start)
        f.write(b"\0" * (st.st_size - data_start))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    (tmp_path / "manifest.json").unlink()

    second = run_extract(dataset, target, tmp_path)
    assert LOADING_LINE not in capfd.readouterr().err
    assert second == first


def test_a_changed_config_gets_a_new_cache(tmp_path, random_llama_target):
    dataset = write_dataset(tmp_path / "train.parquet", 4)
    a = run_extract(dataset, random_llama_target, tmp_path)
    b = run_extract(dataset, random_llama_target, tmp_path, aux_layer_ids=[1, 2, 3])
    c = run_extract(dataset, random_llama_target, tmp_path, shard_tokens=50)
    assert len({a["fingerprint"], b["fingerprint"], c["fingerprint"]}) == 3
    assert json.loads((tmp_path / "manifest.json").read_text()) == c


def test_bad_inputs_fail_before_any_work(tmp_path, random_llama_target):
    out = tmp_path / "out"
    empty = tmp_path / "empty.parquet"
    pd.DataFrame({"id": pd.Series([], dtype=str), "input_ids": pd.Series([], dtype=object),
                  "loss_mask": pd.Series([], dtype=object),
                  "num_tokens": pd.Series([], dtype=np.int32)}).to_parquet(empty)
    with pytest.raises(ValueError, match="empty.parquet: the dataset is empty"):
        run_extract(empty, random_llama_target, out)

    dataset = write_dataset(tmp_path / "train.parquet", 3)
    with pytest.raises(ValueError, match=r"\[8\] out of range.*8 decoder layers"):
        run_extract(dataset, random_llama_target, out, aux_layer_ids=[2, 8])

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(random_llama_target / "config.json", no_weights)
    with pytest.raises(FileNotFoundError, match="no weight files"):
        run_extract(dataset, no_weights, out)

    table = pd.read_parquet(dataset)
    table.loc[1, "num_tokens"] += 1
    table.to_parquet(tmp_path / "bad_len.parquet")
    with pytest.raises(ValueError, match=r"bad_len.parquet: row 1 \(id sample-1\): num_tokens"):
        run_extract(tmp_path / "bad_len.parquet", random_llama_target, out)

    table = pd.read_parquet(dataset)
    table.at[2, "input_ids"] = np.array([1, 512], dtype=np.int32)
    table.at[2, "loss_mask"] = np.array([0, 1], dtype=np.int8)
    table.loc[2, "num_tokens"] = 2
    table.to_parquet(tmp_path / "bad_id.parquet")
    with pytest.raises(ValueError, match=r"row 2 \(id sample-2\): token id outside"):
        run_extract(tmp_path / "bad_id.parquet", random_llama_target, out)
    assert not out.exists()  # nothing written, no cache made


# ----------------------------------------------------------------------------- at scale

def test_partitions_merge_to_what_one_partition_writes(tmp_path, random_llama_target):
    dataset = write_dataset(tmp_path / "train.parquet", 30)
    single = run_extract(dataset, random_llama_target, tmp_path / "single")
    parted = tmp_path / "parted"
    parts = [run_extract(dataset, random_llama_target, parted, partition=(k, 3),
                         manifest_name=partition_manifest_name(k, 3)) for k in (2, 0, 1)]
    tokens = sorted(p["num_tokens"] for p in parts)
    shard_max = max(s["num_tokens"] for s in single["shards"])
    assert sum(tokens) == single["num_tokens"] and tokens[-1] - tokens[0] <= 2 * shard_max  # balanced
    # A partition's manifest is usable on its own (streaming: extract k, train on it, delete it).
    alone = shards.load_manifest(parted / partition_manifest_name(1, 3))
    assert sum(1 for _ in alone.iter_samples()) == alone.data["num_samples"] > 0

    part_files = [str(parted / partition_manifest_name(k, 3)) for k in range(3)]
    shards_main(["merge", "--part", *part_files, "--manifest", str(parted / "manifest.json")])
    merged = json.loads((parted / "manifest.json").read_text())
    assert merged["shards"] == single["shards"]  # same files, bitwise (sha256)
    differs = {k for k in single if single[k] != merged.get(k)}
    assert differs == {"shard_dir", "partition"} and merged["partitions"] == 3
    samples = list(shards.load_manifest(parted / "manifest.json").iter_samples())
    reference = list(shards.load_manifest(tmp_path / "single" / "manifest.json").iter_samples())
    assert [s["id"] for s in samples] == [s["id"] for s in reference]
    assert all(torch.equal(a["aux_hidden_states"], b["aux_hidden_states"]) for a, b in zip(samples, reference))
    logged = (parted / "throughput.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["shard"] for line in logged) == list(range(len(single["shards"])))

    with pytest.raises(ValueError, match="partition 1 of 3, but 2 partition manifests"):
        shards_main(["merge", "--part", *part_files[1:], "--manifest", str(tmp_path / "x.json")])
    other = run_extract(dataset, random_llama_target, tmp_path / "other", shard_tokens=50,
                        partition=(0, 3), manifest_name="p0.json")
    with pytest.raises(ValueError, match="fingerprint .* differs"):
        shards.merge_manifests([other, parts[2], parts[0]], ["p0.json", "b", "c"])


def test_fp8_storage_halves_the_bytes_within_its_error_bound(tmp_path, random_llama_target):
    # Per-token, per-layer magnitudes from 1e-3 to 1e3: one scale per token and layer.
    torch.manual_seed(0)
    lengths, hidden, layers = [5, 9, 3], 64, 3
    aux = [torch.randn(n, layers * hidden) * torch.logspace(-3, 3, n)[:, None] for n in lengths]
    aux[0][:, :hidden] = 0  # all-zero rows keep scale 1, no division by zero
    last = [torch.randn(n, hidden) * 50 for n in lengths]
    ids = [torch.arange(n, dtype=torch.int32) for n in lengths]
    masks = [torch.ones(n, dtype=torch.uint8) for n in lengths]
    names = ["a", "b", "c"]
    bf16 = shards.write_shard(tmp_path / "bf16.safetensors", names, ids, masks,
                              [a.bfloat16() for a in aux], [h.bfloat16() for h in last])
    fp8 = shards.write_shard(tmp_path / "fp8.safetensors", names, ids, masks, aux, last,
                             storage_dtype="fp8")
    tokens, index = sum(lengths), 8 * (len(lengths) + 1)  # cu_seqlens

    def header(path):
        return 8 + int.from_bytes(path.read_bytes()[:8], "little")
    bf16_data = bf16["bytes"] - header(tmp_path / "bf16.safetensors") - index
    fp8_data = fp8["bytes"] - header(tmp_path / "fp8.safetensors") - index
    assert bf16_data == tokens * shards.bytes_per_token(layers, hidden, torch.bfloat16)
    assert fp8_data == tokens * shards.bytes_per_token(layers, hidden, "fp8")
    scales = tokens * (layers + 1) * 4
    assert fp8_data - scales - 5 * tokens == (bf16_data - 5 * tokens) // 2  # exactly half + scales
    assert shards.verify_shard(tmp_path / "fp8.safetensors", fp8["sha256"])

    tensors, _ = shards.read_shard(tmp_path / "fp8.safetensors")  # dequantized transparently
    assert tensors["aux_hidden_states"].dtype == torch.float32 and "aux_hidden_states_scale" not in tensors
    for name, original in (("aux_hidden_states", torch.cat(aux)), ("last_hidden_state", torch.cat(last))):
        groups = original.shape[1] // hidden
        amax = original.view(tokens, groups, hidden).abs().amax(-1, keepdim=True).expand(-1, -1, hidden)
        error = (tensors[name] - original).abs().view(tokens, groups, hidden)
        # e4m3: 3 mantissa bits -> relative error <= 2^-4; subnormals: <= 2^-10 * amax/448.
        bound = torch.maximum(original.abs().view_as(error) * 2**-4, amax * 2**-10 / 448)
        assert (error <= bound * 1.0001).all(), name
    assert (tensors["aux_hidden_states"][:5, :hidden] == 0).all()

    # End to end: an fp8 extraction reads back close to the float32 one, at ~1/4 the bytes.
    dataset = write_dataset(tmp_path / "train.parquet", 8)
    full = run_extract(dataset, random_llama_target, tmp_path / "fp32")
    small = run_extract(dataset, random_llama_target, tmp_path / "fp8", storage_dtype="fp8")
    assert small["storage_dtype"] == "float8_e4m3fn" and small["fingerprint"] != full["fingerprint"]
    assert small["bytes_per_token"] == 5 * (64 + 4) + 5 and full["bytes_per_token"] == 5 * 64 * 4 + 5
    for a, b in zip(shards.load_manifest(tmp_path / "fp8" / "manifest.json").iter_samples(),
                    shards.load_manifest(tmp_path / "fp32" / "manifest.json").iter_samples()):
        torch.testing.assert_close(a["aux_hidden_states"], b["aux_hidden_states"], rtol=0.07, atol=1e-3)


def test_disk_without_room_fails_before_the_model_loads(tmp_path, random_llama_target, monkeypatch, capfd):
    dataset = write_dataset(tmp_path / "train.parquet", 10)
    table_tokens = int(pd.read_parquet(dataset).num_tokens.sum())
    per_token = (len(AUX) + 1) * 64 * 4 + 5
    real = shutil.disk_usage
    # The disk: as many bytes free as the shards need, minus one token's worth.
    monkeypatch.setattr(extraction.shutil, "disk_usage", lambda path: real(path)._replace(
        free=table_tokens * per_token - per_token))
    with pytest.raises(OSError, match=r"GiB free, but the shards still to extract need about .* "
                                      rf"{table_tokens:,} tokens x {per_token:,} bytes.*fp8"):
        run_extract(dataset, random_llama_target, tmp_path / "out")
    assert LOADING_LINE not in capfd.readouterr().err and not shard_files(tmp_path / "out" / "cache")
    # fp8 needs a quarter of float32's bytes: it fits.
    assert run_extract(dataset, random_llama_target, tmp_path / "out", storage_dtype="fp8")["num_tokens"] == table_tokens


def test_samples_over_the_target_context_follow_the_length_policy(tmp_path, random_llama_target):
    # The random target's context (max_position_embeddings) is 512 tokens.
    dataset = write_dataset(tmp_path / "train.parquet", 4, min_len=500, max_len=530, seed=3)
    lengths = pd.read_parquet(dataset).num_tokens.tolist()
    over = sum(n > 512 for n in lengths)
    assert 0 < over < 4, lengths
    cut = run_extract(dataset, random_llama_target, tmp_path / "cut", batch_tokens=600, shard_tokens=4000)
    assert cut["truncated_samples"] == over and cut["num_tokens"] == sum(min(n, 512) for n in lengths)
    dropped = run_extract(dataset, random_llama_target, tmp_path / "drop", batch_tokens=600,
                          shard_tokens=4000, length_policy="drop")
    assert dropped["dropped_samples"] == over and dropped["num_samples"] == 4 - over
    kept = [s["id"] for s in shards.load_manifest(tmp_path / "drop" / "manifest.json").iter_samples()]
    assert kept == [f"sample-{i}" for i, n in enumerate(lengths) if n <= 512]


# ----------------------------------------------------------------------------- issue 14

def read_bytes_so_far() -> int:
    """Bytes this process has read through read() calls (page cache hits included)."""
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")))


def add_sparse_weight_file(target: Path, gib: int) -> Path:
    """A valid safetensors file of one `gib` GiB tensor whose data is a hole (no disk used)."""
    size = gib << 30
    header = json.dumps({"big.weight": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    path = target / "model-extra.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + size)
    return path


def test_target_identity_reads_headers_not_the_weights(tmp_path, random_llama_target):
    """A 595 GB checkpoint must not be read (inside the drain) to key the cache: the
    identity reads each safetensors file's header and stats it, nothing of its data."""
    target = tmp_path / "target"
    shutil.copytree(random_llama_target, target)
    add_sparse_weight_file(target, 4)
    dataset = write_dataset(tmp_path / "train.parquet", 6)
    before, t0 = read_bytes_so_far(), time.monotonic()
    x = extraction.prepare(dataset, target, tmp_path / "m.json", tmp_path / "cache", device="cpu")
    read, took = read_bytes_so_far() - before, time.monotonic() - t0
    assert read < 64 << 20, f"read {read / 2**30:.2f} GiB of weights to key the cache"
    entry = target_identity(target)["files"]["model-extra.safetensors"]
    assert entry["bytes"] == (target / "model-extra.safetensors").stat().st_size and entry["header_sha256"]
    assert json.loads((x.shard_dir / "fingerprint.json").read_text())["target_identity"] == target_digest(target)
    print(f"identity of a 4 GiB target: {took:.2f} s, {read / 2**20:.1f} MiB read")


def test_target_identity_follows_the_files_not_the_path(tmp_path, random_llama_target):
    """A copy keeping the mtimes (cp -a, rsync -a) keeps the cache; a copy with new mtimes
    cannot be told from a rewrite (no data is hashed) and gets a new one, as do other
    weights; a model card edit changes nothing."""
    dataset = write_dataset(tmp_path / "train.parquet", 6)
    key = lambda target: extraction.prepare(dataset, target, tmp_path / "m.json", tmp_path / "cache",
                                               device="cpu").key
    kept = tmp_path / "kept"
    shutil.copytree(random_llama_target, kept)                                  # copy2: mtimes kept
    (kept / "README.md").write_text("a model card")
    assert key(kept) == key(random_llama_target)
    renewed = tmp_path / "renewed"
    shutil.copytree(random_llama_target, renewed, copy_function=shutil.copyfile)   # new mtimes
    os.utime(renewed / "model.safetensors", ns=(0, (kept / "model.safetensors").stat().st_mtime_ns + 10**9))
    assert key(renewed) != key(random_llama_target)
    retrained = make_random_llama(tmp_path / "retrained", seed=1)
    assert key(retrained) != key(random_llama_target)


def test_backend_auto_resolves_to_hf_without_several_gpus():
    assert extract_cli.resolve_backend("cpu") == "hf"
    if torch.cuda.device_count() < 2:
        assert extract_cli.resolve_backend("auto") == "hf"


def test_fp8_batches_dequantized_after_collation_equal_the_host_path(tmp_path):
    # The GPU loader collates fp8 as stored and dequantizes after the copy; the bits must be
    # those of the host path (per-sample dequantization, then concatenation).
    from eagle3flow.train.data import ShardData, collate, dequantize_batch
    from support.builders import make_random_shards

    data = ShardData(shards.load_manifest(make_random_shards(tmp_path, [7, 12, 5, 9, 3], hidden=16)))
    assert data.hidden_dtype == torch.float32           # the dtype the extraction computed in
    batch = [(1, 0), (0, 2), (0, 0)]                    # across shards, out of order
    host = collate(data, batch, num_steps=3)
    stored = collate(data, batch, num_steps=3, dequantize=False)
    assert stored["aux"].dtype == shards.FP8 and stored["aux_scale"].shape == (stored["aux"].shape[0], 3)
    late = dequantize_batch(stored, data.hidden_dtype)
    assert set(late) == set(host) and "aux_scale" not in late
    for key in host:
        assert torch.equal(late[key], host[key]), key
    assert host["aux"].dtype == torch.float32 and host["aux"].abs().max() > 0
