"""regenerate_responses against a real vLLM CPU server of an embedded target.

One tiny embedded target (built here in seconds) is served once for the module by the
stage's own ``serve_target``; a real HTTP proxy process (tests/support/error_proxy.py) in front
of it records every request and fails chosen ones. Requests that reach vLLM are
counted at its /metrics.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from eagle3flow.data.dataset import DatasetConfig, prepare_dataset
from eagle3flow.data.order import iter_conversations
from eagle3flow.data.regenerate import ResponseCache, assistant_message, main, reasoning_form
from eagle3flow.serving.vllm_server import SERVED_NAME, resolve_serve_dtype, serve_target
from support.builders import TOOL_ROW, TOOLS
from support.deadline import deadline
from support.fault_rows import record, yes
from support.targets import make_chat_tokenizer

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
NUM_CONVERSATIONS = 40
FAST_RETRIES = {"backoff_s": 0.01, "max_backoff_s": 0.05, "max_retries": 3}
# One bad row of 41 is more than the default 1%; no eval split, so every sample is in train.
PREPARE = DatasetConfig(max_bad_fraction=0.1, eval_fraction=0.0)


# ----------------------------------------------------------------------------- unit

def test_reasoning_kept_in_the_form_the_template_expects(tmp_path):
    reply = {"content": "42.", "reasoning": "six times seven"}
    assert assistant_message(reply, "field") == {"role": "assistant", "content": "42.",
                                                 "reasoning_content": "six times seven"}
    assert assistant_message(reply, "think_tags")["content"] == "<think>\nsix times seven\n</think>\n\n42."
    assert assistant_message({"content": "42.", "reasoning_content": "r"}, "drop") == {
        "role": "assistant", "content": "42."}
    assert assistant_message({"content": "42.", "reasoning": None}, "field") == {
        "role": "assistant", "content": "42."}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% if message.reasoning_content %}<think>{% endif %}"}))
    assert reasoning_form("auto", str(tmp_path)) == "field"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ m }}"}))
    assert reasoning_form("auto", str(tmp_path)) == "think_tags"


def test_cache_drops_a_line_cut_by_a_kill(tmp_path):
    path = tmp_path / "responses.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt_sha": "x"}) + "\n" + '{"id": "b", "pro')
    cache = ResponseCache(path)
    cache.add({"id": "c", "prompt_sha": "y"})
    cache.close()
    assert set(cache.entries) == {"a", "c"}
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "c"]


# ----------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> Path:
    """A tiny embedded target (the real builder, few steps) and its conversations;
    EAGLE3FLOW_EMBEDDED_DIR reuses an existing build (as tests/test_embedded.py does)."""
    existing = os.environ.get("EAGLE3FLOW_EMBEDDED_DIR")
    if existing:
        return Path(existing)
    out = tmp_path_factory.mktemp("embedded_tiny")
    subprocess.run([sys.executable, "-m", "eagle3flow.embedded.build", "--out-dir", str(out),
                    "--config-json", json.dumps({"train_steps": 80, "max_conversations": 150})], cwd=REPO, env=ENV, check=True,
                   capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def dataset(embedded, tmp_path_factory) -> Path:
    """NUM_CONVERSATIONS conversations (some multi-turn, ShareGPT ids kept) plus one bad row."""
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    lines = (embedded / "conversations.jsonl").read_text().splitlines()[:NUM_CONVERSATIONS]
    # A prompt-only row ({user}) would be answered (regenerate answers trailing user turns):
    # the unusable row is one that opens with an answer to nothing.
    lines.append(json.dumps({"id": "no-answer", "messages": [{"role": "assistant", "content": "hi"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def server(embedded, tmp_path_factory):
    with serve_target(embedded / "target", tmp_path_factory.mktemp("server") / "vllm.log",
                      max_model_len=1024, startup_timeout_s=600, dtype=resolve_serve_dtype("auto")) as url:
        yield url


def requests_served(url: str) -> float:
    """vLLM's own count of finished requests (every finished_reason), once it is idle."""
    until = time.monotonic() + 60
    while True:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
        if busy == 0 or time.monotonic() > until:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:request_success_total{"))
        time.sleep(0.2)


class Proxy:
    def __init__(self, upstream: str, workdir: Path, rules: dict):
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "rules.json").write_text(json.dumps(rules))
        self.record = workdir / "requests.jsonl"
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "support" / "error_proxy.py"), "--upstream", upstream,
             "--rules", str(workdir / "rules.json"), "--record", str(self.record)],
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), line
        self.url = f"http://127.0.0.1:{line.split()[1]}"

    def requests(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def proxy(server, tmp_path):
    proxies = []

    def start(rules: dict | None = None) -> Proxy:
        proxies.append(Proxy(server, tmp_path / f"proxy{len(proxies)}", rules or {}))
        return proxies[-1]

    yield start
    for p in proxies:
        p.close()


def regenerate_args(dataset: Path, embedded: Path, out: Path, url: str, **cfg) -> list[str]:
    settings = {"base_url": url, "max_tokens": 24, "max_concurrency": 4, **cfg}
    return ["--input", str(dataset), "--tokenizer", str(embedded / "target"), "--out-dir", str(out / "out"),
            "--cache-root", str(out / "cache"), "--config-json", json.dumps(settings)]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(server, embedded, dataset, tmp_path_factory):
    """One complete regeneration through a recording proxy, with an API token set."""
    work = tmp_path_factory.mktemp("full")
    proxy = Proxy(server, work / "proxy", {})
    before = requests_served(server)
    os.environ["EAGLE3FLOW_REGENERATE_API_KEY"] = "sekret-token-123"
    try:
        result = subprocess.run([sys.executable, "-m", "eagle3flow.data.regenerate",
                                 *regenerate_args(dataset, embedded, work, proxy.url)],
                                env={**ENV, "EAGLE3FLOW_REGENERATE_API_KEY": "sekret-token-123"},
                                capture_output=True, text=True, timeout=300)
    finally:
        os.environ.pop("EAGLE3FLOW_REGENERATE_API_KEY")
        proxy.close()
    assert result.returncode == 0, result.stderr[-3000:]
    return {"work": work, "stderr": result.stderr, "requests": proxy.requests(),
            "served": requests_served(server) - before}


@pytest.mark.slow  # shares one vLLM server (~25 s to start on 2 idle cores)
def test_full_regeneration(full_run, server, dataset, embedded):
    expected = [(sid, msgs) for sid, msgs in iter_conversations(str(dataset)) if isinstance(msgs, list)]
    rows = read_rows(full_run["work"] / "out" / "responses.jsonl")
    stats = json.loads((full_run["work"] / "out" / "stats.json").read_text())
    # Every usable conversation, in prepare_dataset's order, every assistant turn answered.
    assert [r["id"] for r in rows] == [sid for sid, _ in expected]
    turns = sum(m["role"] == "assistant" for _, msgs in expected for m in msgs)
    assert stats["regenerated"] == NUM_CONVERSATIONS and stats["turns"] == turns
    assert stats["bad_input_rows"]["rows"][0]["id"] == "no-answer"
    assert full_run["served"] == turns == stats["sent"]["requests"]
    assert "ETA" in full_run["stderr"] and "tokens/s" in full_run["stderr"]

    # The answers are the server's: the same greedy request, sent directly, gives the same text.
    sid, messages = next((s, m) for s, m in expected if len(m) == 2)
    body = {"model": SERVED_NAME, "messages": messages[:1], "max_tokens": 24, "temperature": 0.0}
    direct = json.loads(urllib.request.urlopen(urllib.request.Request(
        server + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"}), timeout=60).read())
    row = next(r for r in rows if r["id"] == sid)
    assert row["messages"][1]["content"] == direct["choices"][0]["message"]["content"]
    assert messages[1]["content"] != row["messages"][1]["content"]  # not the dataset's answer

    # Multi-turn: turn 2 is asked with the target's own turn-1 answer in context.
    multi = [r for r in rows if len(r["finish_reasons"]) == 2]
    assert multi, "the test data must hold a multi-turn conversation"
    # (not `row`: the sample checked below is the one above)
    for turns_row in multi:
        second = next(q["body"] for q in full_run["requests"]
                      if q["body"]["messages"][:-1] == turns_row["messages"][:-2])
        assert second["messages"][-2] == {"role": "assistant", "content": turns_row["messages"][-3]["content"]}
    # Sampling settings and the token: sent, never logged.
    assert {q["body"]["max_tokens"] for q in full_run["requests"]} == {24}
    assert {q["authorization"] for q in full_run["requests"]} == {"Bearer sekret-token-123"}
    for text in (full_run["stderr"], json.dumps(stats)):
        assert "sekret" not in text

    # The prepared dataset trains on these answers and says so.
    out = full_run["work"] / "dataset"
    prepared = prepare_dataset(str(dataset), embedded / "target", out, PREPARE,
                               regenerated=full_run["work"] / "out" / "responses.jsonl")
    assert prepared["regenerated"]["samples"] == prepared["rows"]["kept"] == NUM_CONVERSATIONS
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(embedded / "target")
    table = pq.read_table(out / "train.parquet").to_pylist()
    sample = next(t for t in table if t["id"] == sid)
    learned = tok.decode([i for i, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
    assert row["messages"][1]["content"].strip() in learned


@pytest.mark.slow  # shares one vLLM server (~25 s to start on 2 idle cores)
def test_crash_then_resume_sends_only_the_missing(full_run, server, proxy, dataset, embedded, tmp_path):
    slow = proxy({"delay_s": 0.15})
    args = regenerate_args(dataset, embedded, tmp_path, slow.url, max_concurrency=2)
    child = subprocess.Popen([sys.executable, "-m", "eagle3flow.data.regenerate", *args], env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cache_files = lambda: list((tmp_path / "cache").glob("*/responses.jsonl"))  # noqa: E731
    until = time.monotonic() + 120
    while not (cache_files() and len(cache_files()[0].read_text().splitlines()) >= 8):
        assert child.poll() is None, child.stderr.read()[-3000:]
        assert time.monotonic() < until, "no progress"
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    slow.close()  # its requests in flight die with it, before vLLM's count is read
    time.sleep(0.5)
    assert not (tmp_path / "out" / "stats.json").exists()  # the declared output waits for all

    cached = {json.loads(line)["id"] for line in cache_files()[0].read_text().splitlines()}
    assert 8 <= len(cached) < NUM_CONVERSATIONS
    missing = [msgs for sid, msgs in iter_conversations(str(dataset))
               if isinstance(msgs, list) and sid not in cached]
    before = requests_served(server)
    assert main(regenerate_args(dataset, embedded, tmp_path, server)) == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["sent"]["conversations"] == len(missing)
    assert requests_served(server) - before == sum(m["role"] == "assistant" for msgs in missing for m in msgs)
    # Greedy answers: crash + resume gives exactly what one uninterrupted run gave.
    assert read_rows(tmp_path / "out" / "responses.jsonl") == read_rows(full_run["work"] / "out" / "responses.jsonl")


@pytest.mark.slow  # shares one vLLM server (~25 s to start on 2 idle cores)
def test_more_answers_per_prompt_are_sampled_cached_and_trained_on(full_run, proxy, dataset, embedded, tmp_path):
    """answers_per_prompt 3: the one-answer run's cache serves the first answers, two more
    per conversation are sampled at extra_temperature with seeds of their own; a rerun
    asking for fewer sends only what failed; the dataset trains on the further answers of
    its train prompts only."""
    import pyarrow.parquet as pq

    shutil.copytree(full_run["work"] / "cache", tmp_path / "cache")
    conversations = {sid: msgs for sid, msgs in iter_conversations(str(dataset)) if isinstance(msgs, list)}
    answers_in = {sid: sum(m["role"] == "assistant" for m in msgs) for sid, msgs in conversations.items()}
    # A sampled answer of the tiny target can be empty: such an answer fails and is left out.
    settings = {"extra_temperature": 1.0, "max_failed_fraction": 0.2}
    recorder = proxy()
    assert main(regenerate_args(dataset, embedded, tmp_path, recorder.url, answers_per_prompt=3, **settings)) == 0
    sent = [q["body"] for q in recorder.requests()]
    failed = json.loads((tmp_path / "out" / "stats.json").read_text())["failed"]["rows"]
    assert all("~answer" in f["id"] for f in failed) and len(failed) < NUM_CONVERSATIONS // 4
    # Every further answer asked (a failed one may stop before its last turn).
    assert 2 * sum(answers_in.values()) - 2 * len(failed) <= len(sent) <= 2 * sum(answers_in.values())
    assert {q["temperature"] for q in sent} == {1.0}
    assert len({(q["seed"], json.dumps(q["messages"])) for q in sent}) == len(sent)
    rows = read_rows(tmp_path / "out" / "responses.jsonl")
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    first = read_rows(full_run["work"] / "out" / "responses.jsonl")
    assert [{k: r[k] for k in ("id", "messages", "finish_reasons")} for r in rows] == first
    assert sum(len(r["more_answers"]) for r in rows) == stats["more_answers"] == 2 * NUM_CONVERSATIONS - len(failed)
    assert stats["turns"] == sum(answers_in.values()) + sum(len(m["finish_reasons"]) for r in rows
                                                          for m in r["more_answers"])
    # Sampled, so unlike the greedy first answer (two equal greedy-length samples are rare).
    differing = sum(more["messages"] != r["messages"] for r in rows for more in r["more_answers"])
    assert differing >= NUM_CONVERSATIONS

    again = proxy()
    assert main(regenerate_args(dataset, embedded, tmp_path, again.url, answers_per_prompt=2, **settings)) == 0
    retried = {f["id"].split("~answer")[0] for f in failed if f["id"].endswith("~answer2")}
    assert len(again.requests()) <= sum(answers_in[sid] for sid in retried)
    fewer = read_rows(tmp_path / "out" / "responses.jsonl")
    assert [r["more_answers"][:1] for r in fewer if r["id"] not in retried] == \
        [r["more_answers"][:1] for r in rows if r["id"] not in retried]
    assert all(len(r["more_answers"]) <= 1 for r in fewer)
    assert all(m["id"].startswith(r["id"] + "~answer") for r in rows for m in r["more_answers"])

    prepared = prepare_dataset(str(dataset), embedded / "target", tmp_path / "dataset",
                               DatasetConfig(max_bad_fraction=0.1, eval_fraction=0.2),
                               regenerated=tmp_path / "out" / "responses.jsonl")
    train = pq.read_table(tmp_path / "dataset" / "train.parquet").column("id").to_pylist()
    held_out = pq.read_table(tmp_path / "dataset" / "eval.parquet").column("id").to_pylist()
    assert held_out and not any("~answer" in sid for sid in held_out)
    with_second = {r["id"] for r in fewer if r["more_answers"]}
    firsts = [sid for sid in train if "~answer" not in sid]
    assert sorted(sid for sid in train if "~answer" in sid) == sorted(
        r["more_answers"][0]["id"] for r in fewer if r["id"] in firsts and r["more_answers"])
    # Each further answer follows its first: the train split keeps the processing order.
    assert all(train[i - 1].split("~answer")[0] == sid.split("~answer")[0]
               for i, sid in enumerate(train) if "~answer" in sid)
    assert prepared["regenerated"]["more_answers"]["samples"] == len([s for s in firsts if s in with_second])
    assert len(firsts) + len(held_out) == NUM_CONVERSATIONS


@pytest.mark.slow  # shares one vLLM server (~25 s to start on 2 idle cores)
def test_server_errors_are_retried_then_skipped_or_fail(server, proxy, dataset, embedded, tmp_path, capsys):
    # Single-turn conversations, matched by their question (follow-ups repeat across rows).
    ids = [(sid, msgs) for sid, msgs in iter_conversations(str(dataset))
           if isinstance(msgs, list) and sum(m["role"] == "assistant" for m in msgs) == 1]
    first_user = lambda k: ids[k][1][-2]["content"]  # noqa: E731
    faulty = proxy({"fail": [{"match": first_user(0), "status": 429, "times": 2, "retry_after": "0"},
                             {"match": first_user(1), "status": 503, "times": 1},
                             {"match": first_user(2), "status": 500, "times": None}]})
    # max_tokens 1: every answer is cut (a first token that is a stop token or blank makes an
    # empty answer, which fails that conversation: the tiny target does that now and then).
    args = regenerate_args(dataset, embedded, tmp_path, faulty.url, max_tokens=1, max_failed_fraction=0.2,
                           **FAST_RETRIES)
    assert main(args) == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    failed = {row["id"]: row["reason"] for row in stats["failed"]["rows"]}
    reason = failed.pop(ids[2][0])
    assert "HTTP 500" in reason and "after 4 attempts" in reason
    assert all("empty answer" in reason for reason in failed.values()), failed
    assert stats["sent"]["retries"] == 2 + 1 + 3
    rows = {r["id"]: r for r in read_rows(tmp_path / "out" / "responses.jsonl")}
    assert "messages" in rows[ids[0][0]] and "messages" in rows[ids[1][0]] and "failed" in rows[ids[2][0]]
    assert stats["truncated"]["count"] == stats["regenerated"] == NUM_CONVERSATIONS - 1 - len(failed)
    # The dataset leaves the failed conversations out, listed with their reasons.
    prepared = prepare_dataset(str(dataset), embedded / "target", tmp_path / "dataset", PREPARE,
                               regenerated=tmp_path / "out" / "responses.jsonl")
    skipped = prepared["regenerated"]["skipped"]
    assert {r["id"] for r in skipped["rows"]} == {ids[2][0], *failed}
    assert skipped["by_reason"] == {"regeneration failed": 1 + len(failed)}
    assert prepared["regenerated"]["truncated_answers"] == prepared["rows"]["kept"] == stats["regenerated"]

    # Above max_failed_fraction the stage fails and names the prompt; the answers stay cached.
    capsys.readouterr()
    strict = regenerate_args(dataset, embedded, tmp_path / "strict", faulty.url, max_tokens=1,
                             max_failed_fraction=0.0, **FAST_RETRIES)
    assert main(strict) == 1
    err = capsys.readouterr().err
    assert "max_failed_fraction" in err and ids[2][0] in err and "HTTP 500" in err
    assert not (tmp_path / "strict" / "out").exists()


@pytest.mark.slow  # shares one vLLM server (~25 s to start on 2 idle cores)
def test_further_answers_fail_apart_from_first_answers(server, proxy, dataset, embedded, tmp_path, capsys):
    """A further answer that fails leaves its conversation in, and further answers are held
    to max_failed_fraction among themselves; a conversation whose first answer failed gets
    no further answer asked."""
    ids = [(sid, msgs) for sid, msgs in iter_conversations(str(dataset))
           if isinstance(msgs, list) and sum(m["role"] == "assistant" for m in msgs) == 1]
    first_user = lambda k: ids[k][1][-2]["content"]  # noqa: E731
    only_further = {"match": first_user(0), "status": 500, "times": None, "temperature": 1.0}
    faulty = proxy({"fail": [only_further,
                             {"match": first_user(1), "status": 500, "times": None, "temperature": 0.0}]})
    settings = dict(answers_per_prompt=3, extra_temperature=1.0, max_failed_fraction=0.1, **FAST_RETRIES)
    assert main(regenerate_args(dataset, embedded, tmp_path, faulty.url, **settings)) == 0
    rows = {r["id"]: r for r in read_rows(tmp_path / "out" / "responses.jsonl")}
    assert rows[ids[0][0]]["messages"] and rows[ids[0][0]]["more_answers"] == []
    assert "failed" in rows[ids[1][0]]
    asked = [q["body"] for q in faulty.requests() if q["body"]["messages"][-1]["content"] == first_user(1)]
    assert asked and {q["temperature"] for q in asked} == {0.0}
    failed = {f["id"] for f in json.loads((tmp_path / "out" / "stats.json").read_text())["failed"]["rows"]}
    assert {ids[1][0], f"{ids[0][0]}~answer2", f"{ids[0][0]}~answer3"} <= failed

    # Two failed further answers of 80 are more than 2%: the stage fails and says which kind.
    capsys.readouterr()
    strict = proxy({"fail": [only_further]})
    assert main(regenerate_args(dataset, embedded, tmp_path / "strict", strict.url,
                                **{**settings, "max_failed_fraction": 0.02})) == 1
    err = capsys.readouterr().err
    assert "of 80 further answers failed" in err and f"{ids[0][0]}~answer" in err


@pytest.mark.slow  # shares one vLLM server (~25 s to start on 2 idle cores)
def test_fails_early_when_down_or_wrong_model(server, dataset, embedded, tmp_path, capsys):
    from eagle3flow.serving.vllm_server import free_port

    before = requests_served(server)
    with deadline(60, "a regeneration that should fail at its first request"):
        assert main(regenerate_args(dataset, embedded, tmp_path, f"http://127.0.0.1:{free_port()}")) == 1
        assert "cannot reach the target's server" in capsys.readouterr().err
        assert main(regenerate_args(dataset, embedded, tmp_path, server, model="not-the-target")) == 1
    err = capsys.readouterr().err
    assert f"does not serve model 'not-the-target'; it serves ['{SERVED_NAME}']" in err
    assert requests_served(server) == before  # no prompt was sent
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # shares one vLLM server (~25 s to start on 2 idle cores)
def test_seeded_samples_of_long_prompts_at_once_keep_the_cpu_server_up(server):
    """Further answers are seeded samples; many long prompts at once make vLLM split a
    prompt's prefill over steps, and on CPU (float32 here) its engine died rewinding that
    request's generator ("CPU Generator does not use offset"). The stage's own server
    prefills whole prompts there: every request is answered and the server stays healthy."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> dict:
        body = {"model": SERVED_NAME, "prompt": [(i * 7 + j) % 200 + 10 for j in range(900)], "max_tokens": 4,
                "temperature": 1.0, "seed": 1000 + i}
        request = urllib.request.Request(server + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=300).read())

    # 12 x 900 prompt tokens: more than the 8,192 tokens one step takes, so some prompt waits
    with deadline(300, "twelve seeded 900-token prompts at once"), ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, range(12)))
    assert all(a["choices"][0]["finish_reason"] in ("length", "stop") for a in answers)
    assert urllib.request.urlopen(server + "/health", timeout=10).status == 200


# ----------------------------------------------------------------------------- the DAG

def test_regenerate_runs_before_any_drain(tmp_path):
    """On the drained profile, every drain_service job depends on regenerate_responses
    (the production server must still be up), and prepare_dataset reads its answers."""
    (tmp_path / "regen.yaml").write_text(
        "regenerate:\n  enabled: true\n  base_url: http://127.0.0.1:8000\n"
        "drain:\n  unit: vllm.service\n")
    result = subprocess.run(
        [str(Path(sys.executable).parent / "snakemake"), "-n", "--profile", "profiles/local-8gpu",
         "--configfile", "profiles/local-8gpu/workflow.yaml", str(tmp_path / "regen.yaml"),
         "--forceall", "--dag"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    nodes, edges = {}, set()
    for line in result.stdout.splitlines():
        line = line.strip()
        if "->" in line:
            a, b = (x.strip().rstrip(";") for x in line.split("->"))
            edges.add((a, b))
        elif "label" in line and "[" in line:
            nodes[line.split("[")[0].strip()] = line.split('label = "')[1].split("\\n")[0].split('"')[0]
    upstream = {n: {a for a, b in edges if b == n} for n in nodes}

    def ancestors(node):
        seen, todo = set(), [node]
        while todo:
            for parent in upstream[todo.pop()]:
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        return {nodes[n] for n in seen}

    drains = [n for n, rule in nodes.items() if rule == "drain_service"]
    assert len(drains) >= 2, nodes
    for drain in drains:
        assert "regenerate_responses" in ancestors(drain)
    prepare = next(n for n, rule in nodes.items() if rule == "prepare_dataset")
    assert "regenerate_responses" in ancestors(prepare)


class FakeChatServer:
    """A real HTTP server speaking OpenAI's chat API with one model, ``answer(request)``
    its assistant message. Records requests and their Authorization headers."""

    model = "fake-target"

    def __init__(self, root: str | None = None, reply: str = "An answer."):
        import http.server
        import threading

        self.requests: list[dict] = []
        self.authorizations: list[str | None] = []
        # what it lists as the model's root at /v1/models (vLLM: the path it loaded)
        self.root, self.reply = root, reply
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                server.authorizations.append(self.headers.get("Authorization"))
                listed = {"id": server.model, "object": "model"} | ({"root": server.root} if server.root else {})
                self._json({"object": "list", "data": [listed]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.authorizations.append(self.headers.get("Authorization"))
                self._json({"choices": [{"index": 0, "message": server.answer(body), "finish_reason": "stop"}],
                            "usage": {"prompt_tokens": 10, "completion_tokens": 5}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, request: dict) -> dict:
        return {"role": "assistant", "content": self.reply}

    def close(self):
        self.httpd.shutdown()


def test_the_same_served_name_over_another_model_asks_again(tmp_path, request):
    """Production upgraded under the same --served-model-name: the cache is keyed by what the
    server serves (its /v1/models root, and the target's identity when that root is the
    target directory), so the new model is asked again; the same model is not."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Old."}]}) + "\n"
        for i in range(3)))
    target = tmp_path / "Kimi-K2.5-INT4"
    target.mkdir()
    (target / "config.json").write_text("{}")
    weights = target / "model.safetensors"
    header = json.dumps({"w": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}).encode()
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))

    # One server process-wide whose model changes under the same name (one shutdown: 0.5 s each).
    server = FakeChatServer()
    args = ["--input", str(data), "--out-dir", str(tmp_path / "out"), "--cache-root", str(tmp_path / "cache"),
            "--config-json", json.dumps({"base_url": server.url, "max_tokens": 8, "reasoning": "drop"})]

    def ask(root: str, reply: str, tokenizer: Path | None = None) -> tuple[list[dict], list[str]]:
        server.root, server.reply, server.requests = root, reply, []
        assert main(args + (["--tokenizer", str(tokenizer)] if tokenizer else [])) == 0
        answers = [row["messages"][1]["content"] for row in read_rows(tmp_path / "out" / "responses.jsonl")]
        return server.requests, answers

    request.addfinalizer(server.close)
    sent, answers = ask("/models/old", "from the old model")
    assert len(sent) == 3 and set(answers) == {"from the old model"}
    assert ask("/models/old", "unasked") == ([], ["from the old model"] * 3)      # cached
    sent, answers = ask("/models/new", "from the new model")                     # same name, another model
    assert len(sent) == 3 and set(answers) == {"from the new model"}

    # Served from the target directory itself: the same path with new weights is another model.
    sent, answers = ask(str(target), "first weights", tokenizer=target)
    assert len(sent) == 3 and ask(str(target), "unasked", tokenizer=target)[0] == []
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")     # same size and header
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    sent, answers = ask(str(target), "new weights", tokenizer=target)
    assert len(sent) == 3 and set(answers) == {"new weights"}


class ToolCallingServer(FakeChatServer):
    """A tool-using target: its first answer calls get_weather, its answer after the tool's
    output is text."""

    model = "agent-target"

    def answer(self, request: dict) -> dict:
        if request["messages"][-1]["role"] == "tool":
            return {"role": "assistant", "content": "It is clear in Paris."}
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}]}


def test_tool_calls_are_sent_kept_and_trained_on(tmp_path):
    """An agent row: the tools go with every request, the target's own call is kept (and sent
    back in OpenAI's wire format before the tool's output), and the dataset trains on it."""
    data = tmp_path / "agent.jsonl"
    data.write_text(json.dumps(TOOL_ROW) + "\n")
    server = ToolCallingServer()
    try:
        rc = main(["--input", str(data), "--out-dir", str(tmp_path / "out"), "--cache-root", str(tmp_path / "cache"),
                   "--config-json", json.dumps({"base_url": server.url, "max_tokens": 16})])
    finally:
        server.close()
    assert rc == 0
    first, second = server.requests
    assert first["tools"] == TOOLS and second["tools"] == TOOLS
    call = second["messages"][1]
    assert call["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    assert second["messages"][2] == {"role": "tool", "content": "temperature=18C; sky=clear", "tool_call_id": "call_1"}
    [row] = read_rows(tmp_path / "out" / "responses.jsonl")
    assert row["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "C"}
    assert row["messages"][3]["content"] == "It is clear in Paris."

    tokenizer = make_chat_tokenizer(tmp_path / "tok", "kimi_k2")
    stats = prepare_dataset(str(data), tokenizer, tmp_path / "ds", DatasetConfig(eval_fraction=0.0),
                            regenerated=tmp_path / "out" / "responses.jsonl")
    assert stats["regenerated"]["samples"] == 1 and stats["bad"]["count"] == 0, stats["bad"]
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    table = pq.read_table(tmp_path / "ds" / "train.parquet").to_pylist()[0]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    trained = tok.decode([t for t, m in zip(table["input_ids"], table["loss_mask"]) if m])
    assert "get_weather" in trained and '"unit": "C"' in trained and "clear in Paris" in trained
    assert "temperature=18C" not in trained


def test_credentials_in_base_url_reach_the_server_and_no_command_line_log_or_record(tmp_path):
    """regenerate.base_url with user:password: the job authenticates with them, and neither
    Snakemake's printed commands (-p), its log and metadata, nor the run's results and
    logs hold the password (the URL reaches the job through the environment)."""
    import base64

    from support.workflow import snakemake, workflow_copy

    workdir = workflow_copy(tmp_path / "wf")
    data = workdir / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Old answer."}]}) + "\n"
        for i in range(3)))
    secret = "s3cret-pass-0451"
    server = FakeChatServer()
    config = {"target": {"path": str(make_chat_tokenizer(tmp_path / "tok", "kimi_k2"))},
              "dataset": {"path": str(data)},
              "regenerate": {"enabled": True, "max_tokens": 8, "reasoning": "drop",
                             "base_url": server.url.replace("://", f"://eagle:{secret}@")}}
    (workdir / "secret.json").write_text(json.dumps(config))
    try:
        regenerated = snakemake(workdir, "-p", "--cores", "1", "results/regenerate/responses.jsonl",
                                "--configfile", "config.yaml", "secret.json", timeout=300)
    finally:
        server.close()
    # every other command the run would print, the report's (the whole config) among them
    dry = snakemake(workdir, "-n", "-p", "--cores", "1", "all", "--configfile", "config.yaml", "secret.json",
                    timeout=300)
    assert regenerated.returncode == 0, (regenerated.stdout + regenerated.stderr)[-4000:]
    assert dry.returncode == 0 and "eagle3flow.report.render" in dry.stdout, (dry.stdout + dry.stderr)[-4000:]
    expected = "Basic " + base64.b64encode(f"eagle:{secret}".encode()).decode()
    assert server.requests and set(server.authorizations) == {expected}
    assert len(read_rows(workdir / "results" / "regenerate" / "responses.jsonl")) == 3
    written = [p for folder in ("results", "logs", ".snakemake") for p in (workdir / folder).rglob("*") if p.is_file()]
    leaks = [str(p) for p in written if secret.encode() in p.read_bytes()]
    printed = [name for name, result in (("the run", regenerated), ("a dry run of all", dry))
               if secret in result.stdout + result.stderr]
    record(scenario="a URL with user:password (regenerate.base_url)",
           fault_at="a real regeneration job, then a dry run -p of every rule (the report's among them)",
           unit_healthy="not touched (no GPU stage)", downtime="-", foreign_killed=0, recomputed=0,
           consistent="-",
           notes=f"secrets found by grep -r in the {len(written)} file(s) under results/, logs/, .snakemake/: "
                 f"{len(leaks)}; in Snakemake's output (-p): {len(printed)}; the server got user:password: "
                 f"{yes(set(server.authorizations) == {expected})}")
    assert printed == []
    assert any(p.parts[-3:-1] == (".snakemake", "log") for p in written), "Snakemake's log is among them"
    assert leaks == []


def test_the_command_line_refuses_bad_settings_as_every_stage_does(tmp_path, capsys):
    """--config-json through the one resolver of every stage (config.cli_settings): a key it
    does not take, or a borrowed key of the wrong type, is a usage error naming the key, before
    any input is read; target.trust_remote_code is one of its keys, no flag of its own."""
    base = ["--input", str(tmp_path / "absent.jsonl"), "--out-dir", str(tmp_path / "out"),
            "--cache-root", str(tmp_path / "cache")]
    for settings, named in (({"max_tokenz": 1}, "regenerate: unknown keys ['max_tokenz']"),
                            ({"trust_remote_code": "yes"}, "target.trust_remote_code: 'yes' is not of type 'boolean'")):
        with pytest.raises(SystemExit) as exit_:
            main([*base, "--config-json", json.dumps(settings)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--config-json: {named}" in err, err
    with pytest.raises(SystemExit):
        main([*base, "--trust-remote-code"])
    assert "unrecognized arguments: --trust-remote-code" in capsys.readouterr().err
    # the settings taken, the input is read next
    assert main([*base, "--config-json", json.dumps({"trust_remote_code": True})]) == 1
    assert "absent.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
