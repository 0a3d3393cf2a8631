"""Greedy speculative decoding replayed on known greedy outputs: the simulated acceptance
that must agree with vLLM's own (eagle3flow/eval/evaluate.py, measurement 2). Beside it,
at each sampling temperature, the offline estimate of acceptance along the target's own
sampled answers (:func:`estimate_at_temperature`, eagle3flow/train/rejection_estimate.py).

The HF target captures the aux states of ``prompt + output``, the draft predicts its
chains (``Eagle3Draft.predict_chains``) and :func:`replay_greedy_speculation` replays
the rounds. Each generation's replay is appended to a ``replay*.jsonl`` keyed by a
fingerprint of what determines it, so a rerun redoes only what is missing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from eagle3flow.export.load import load_exported_draft
from eagle3flow.device import resolve_device
from eagle3flow.extract.extraction import resolve_dtype
from eagle3flow.extract.hf import capture, load_target
from eagle3flow.layers import from_layer_outputs
from eagle3flow.model.dflash_config import DFLASH_ARCHITECTURE
from eagle3flow.train.rejection_estimate import expected_acceptance, step_acceptance, tempered
from eagle3flow.progress import Progress
from eagle3flow.target.files import loaded_weight_bytes

# Bump when the replay's meaning changes, so cached per-prompt replays are not reused.
REPLAY_VERSION = 2


def replay_greedy_speculation(chains, token_ids, prompt_len: int, end: int | None = None) -> dict:
    """Replay greedy speculative decoding of one sequence against its known greedy output.

    ``chains [T, K]``: target ids, ``chains[t, j]`` = the draft's guess for index
    ``t+j+2`` given the target's states up to row ``t`` and ``token_ids[..t+1]``.
    ``token_ids [T]`` = prompt + the target's greedy output; ``prompt_len`` = prompt length.

    A round starts at ``p`` once the target has produced ``token_ids[p+1]`` (the first
    round at ``p = prompt_len - 1``, after prefill). The draft proposes indices
    ``p+2..p+K+1``; the accepted count ``n`` is the longest prefix equal to the actual
    greedy tokens (never past the end of the output); the target then adds its own
    token, so ``p += n + 1``. Rounds continue while a token remains to be generated.

    ``end`` (default: all of ``token_ids``): where the generation stopped (prompt length +
    max_tokens), with ``token_ids`` going on past it with the target's greedy tokens.
    vLLM counts a round's accepted drafts before it cuts the output at max_tokens, so a
    last round's drafts past the end count as they match that continuation; without it
    the replay stops counting at the end and can fall short of vLLM's counters there.

    Returns ``{"rounds", "accepted", "accepted_per_pos" [K], "per_round" [rounds]}``.
    """
    chains = chains.tolist() if hasattr(chains, "tolist") else [list(c) for c in chains]
    ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
    known = len(ids)
    total = known if end is None else int(end)
    if len(chains) != known:
        raise ValueError(f"chains have {len(chains)} rows but the sequence has {known} tokens")
    if not 1 <= prompt_len <= total <= known:
        raise ValueError(f"prompt_len {prompt_len}, end {total}: not 1 <= prompt_len <= end <= {known}")
    k = len(chains[0]) if chains else 0
    per_round: list[int] = []
    p = prompt_len - 1
    while p + 2 <= total - 1:
        row = chains[p]
        n = 0
        while n < k and p + 2 + n < known and row[n] == ids[p + 2 + n]:
            n += 1
        per_round.append(n)
        p += n + 1
    return {"rounds": len(per_round), "accepted": sum(per_round),
            "accepted_per_pos": [sum(1 for n in per_round if n > j) for j in range(k)],
            "per_round": per_round}


def acceptance_summary(rounds: int, accepted: int, accepted_per_pos: list[int]) -> dict:
    """Acceptance length ``1 + accepted/rounds`` and per-position rates ``accepted_j / rounds``."""
    return {
        "acceptance_length": 1.0 + accepted / rounds if rounds else None,
        "acceptance_rate_per_position": [a / rounds if rounds else None for a in accepted_per_pos],
        "num_drafts": int(rounds),
        "num_accepted_tokens": int(accepted),
        "num_accepted_tokens_per_pos": [int(a) for a in accepted_per_pos],
    }



def read_draft_config(draft_dir: Path) -> dict:
    config_file = Path(draft_dir) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: missing; --draft must be an exported draft dir")
    if not (Path(draft_dir) / "model.safetensors").is_file():
        raise FileNotFoundError(f"{draft_dir}/model.safetensors: missing")
    with open(config_file) as f:
        config = json.load(f)
    if draft_method(config) == "dflash":
        if not (config.get("dflash_config") or {}).get("target_layer_ids"):
            raise ValueError(f"{config_file}: a DFlash draft without dflash_config.target_layer_ids")
    elif not config.get("eagle_aux_hidden_state_layer_ids"):
        raise ValueError(f"{config_file}: no top-level eagle_aux_hidden_state_layer_ids")
    return config


def draft_method(config: dict) -> str:
    """vLLM's ``speculative_config.method`` for an exported draft's ``config.json``."""
    return "dflash" if DFLASH_ARCHITECTURE in (config.get("architectures") or []) else "eagle3"


def draft_layer_ids(config: dict) -> list[int]:
    """The target layers an exported draft reads, in this project's convention
    (eagle3flow/layers.py): EAGLE-3's top-level ids, or DFlash's layer outputs converted."""
    if draft_method(config) == "dflash":
        return from_layer_outputs(config["dflash_config"]["target_layer_ids"])
    return list(config["eagle_aux_hidden_state_layer_ids"])



def resolve_precision(device: str, dtype: str) -> tuple[torch.device, torch.dtype, str]:
    """The replay's device and dtype for the ``evaluate`` settings, and the dtype's name."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    return torch_device, torch_dtype, str(torch_dtype).replace("torch.", "")


def device_memory_bytes(device: torch.device) -> int:
    """What one replay device holds: a GPU's memory, or the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


# The share of one device the target's weights may take for the replay (activations,
# the draft and the allocator's slack take the rest).
REPLAY_MEMORY_SHARE = 0.85


def replay_decision(setting, target_path: Path, device: str, dtype: str) -> dict:
    """Whether the replay runs (``evaluate.replay``: auto / true / false), and why.

    auto: where the target's weights, loaded in the replay's dtype, fit REPLAY_MEMORY_SHARE
    of one replay device (the replay loads the HF target on one device; a 1T-parameter
    target fits none). Decided from the safetensors headers, before any load."""
    if setting is True or setting is False:
        return {"run": setting, "setting": setting, "reason": f"evaluate.replay: {str(setting).lower()}"}
    if setting != "auto":
        raise ValueError(f"evaluate.replay: {setting!r}; expected auto, true or false")
    torch_device, torch_dtype, dtype_name = resolve_precision(device, dtype)
    weights = loaded_weight_bytes(target_path, torch.empty((), dtype=torch_dtype).element_size())
    memory = device_memory_bytes(torch_device)
    fits = weights <= REPLAY_MEMORY_SHARE * memory
    where = "one GPU's memory" if torch_device.type == "cuda" else "the host's available memory"
    return {"run": fits, "setting": "auto", "target_bytes": weights, "device_bytes": memory,
            "reason": (f"the target's weights in {dtype_name} ({weights / 1e9:,.1f} GB) "
                       f"{'fit' if fits else 'exceed'} {REPLAY_MEMORY_SHARE:.0%} of {where} "
                       f"({memory / 1e9:,.1f} GB on {torch_device})")}


def load_replays(path: Path, key: str) -> dict[str, dict]:
    done = {}
    if path.is_file():
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue   # a line cut by a kill; that prompt is simply redone
                if row.get("fingerprint") == key:
                    done[row["id"]] = row
    return done


def per_answer(draft_dir: Path, target_path: Path, units: list[dict], device: str, dtype: str,
                path: Path, key: str, loaded: dict, label: str, trust_remote_code: bool, by_k,
                describe: str | None = None, load_draft=None) -> dict[str, dict]:
    """``by_k(target, draft, aux_layer_ids, ids, prompt_len, torch_device)`` on each answer of
    ``units`` not yet in ``path`` under ``key``, each row appended as soon as it is done
    (resume); the HF target is loaded once into ``loaded`` (shared across drafts).
    ``load_draft(draft_dir, target_path, dtype, device)``: how the draft loads (default: an
    exported EAGLE-3 draft). Returns ``{unit key: {"by_k": ...}}``."""
    done = load_replays(path, key)
    todo = [u for u in units if u["key"] not in done]
    if todo:
        torch_device, torch_dtype, _ = resolve_precision(device, dtype)
        aux_layer_ids = draft_layer_ids(read_draft_config(draft_dir))
        if describe:
            print(f"evaluate: {label} on {torch_device} ({torch_dtype}), aux layers {aux_layer_ids}, "
                  f"{describe}, {len(done)} of {len(units)} generations cached",
                  file=sys.stderr, flush=True)
        target_key = (str(target_path), str(torch_dtype), str(torch_device))
        if target_key not in loaded:
            loaded[target_key] = load_target(target_path, torch_dtype, torch_device, trust_remote_code)
        target = loaded[target_key]
        if load_draft is None:
            draft = load_exported_draft(draft_dir, target_path, dtype=torch_dtype, device=torch_device).eval()
        else:
            draft = load_draft(draft_dir, target_path, torch_dtype, torch_device)
        progress = Progress(f"evaluate[{label}]", total=len(units), unit="generations",
                            done=len(done))
        with open(path, "a") as f:
            for unit in todo:
                ids = list(unit["prompt_token_ids"]) + list(unit["output_token_ids"])
                row = {"id": unit["key"], "fingerprint": key,
                       "by_k": by_k(target, draft, aux_layer_ids, ids, len(unit["prompt_token_ids"]),
                                    torch_device)}
                f.write(json.dumps(row) + "\n")
                f.flush()
                done[unit["key"]] = row
                progress.update(1)
        progress.close()
    return {u["key"]: done[u["key"]] for u in units}


def simulate_on_outputs(draft_dir: Path, target_path: Path, units: list[dict], max_k: int,
                        device: str, dtype: str, replay_path: Path, key: str,
                        loaded: dict | None = None, label: str = "replay",
                        trust_remote_code: bool = False) -> dict[str, dict]:
    """Replay greedy speculation on each generation (prompt + its vLLM greedy output).

    ``units``: ``[{"key", "prompt_token_ids", "output_token_ids"}]``. Per unit: ``aux
    [T, A*H]`` from the HF target, ``chains [T, max_k]`` from the draft, then
    :func:`replay_greedy_speculation` for every K in ``1..max_k`` on the chains' first K
    columns: one draft pass gives the whole acceptance-vs-K curve, exactly as vLLM would
    have accepted at that K. Each unit's result is appended to ``replay_path`` as soon as
    it is done (resume). ``loaded`` keeps the HF target across drafts (loaded with
    ``trust_remote_code``, ``target.trust_remote_code``). Returns
    ``{unit key: {"by_k": {"K": replay}}}``.
    """
    def by_k(target, draft, aux_layer_ids, ids, prompt_len, torch_device):
        input_ids = torch.tensor([ids], dtype=torch.long, device=torch_device)
        aux, _ = capture(target, input_ids, torch.ones_like(input_ids), aux_layer_ids)
        chains = draft.predict_chains(aux[0], input_ids[0], max_k).cpu()
        return {str(k): replay_greedy_speculation(chains[:, :k], ids, prompt_len)
                for k in range(1, max_k + 1)}

    return per_answer(draft_dir, target_path, units, device, dtype, replay_path, key,
                       {} if loaded is None else loaded, label, trust_remote_code, by_k,
                       describe=f"K=1..{max_k}")


def temperature_alpha(target, draft, aux_layer_ids: list[int], ids: list[int], max_k: int,
                      temperature: float, device, draft_temperature: float | None = None) -> list[list[float]]:
    """Per row ``t`` and step ``j`` of one answer, ``sum_x min(p, q)``: ``p`` the target's
    distribution for index ``t + 2 + j`` at ``temperature`` (its logits at row ``t + 1 + j``),
    ``q`` the draft's step ``j`` from row ``t`` at ``draft_temperature`` (default: the same;
    vLLM's probabilistic draft sampling tempers the draft's logits with the request's
    temperature; 0 where the draft proposes its argmax, which the rejection sampler then
    takes as a one-hot proposal: ``alpha = p(argmax q)``), over the
    draft's vocabulary mapped to target ids (the target's mass outside it is never
    proposed). The draft's later steps are fed the answer's own tokens (teacher forcing):
    where a step is accepted, the token it proposed is the answer's next one."""
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    aux, last = capture(target, input_ids, torch.ones_like(input_ids), aux_layer_ids)
    with torch.no_grad():
        p = tempered(target.lm_head(last[0]), temperature)                 # [T, V]
        cu = torch.tensor([0, len(ids)], device=device)
        logits, _ = draft.forward_ttt(aux[0], input_ids[0], cu, max_k)
    total = len(ids)
    alpha = torch.zeros(total, max_k)
    draft_targets = draft.draft_to_target(torch.arange(draft.d2t.numel(), device=device))
    for j, step_logits in enumerate(logits):
        q = tempered(step_logits, temperature if draft_temperature is None else draft_temperature)
        rows = total - 1 - j           # rows t with a target distribution at row t + 1 + j
        if rows <= 0:
            break
        p_at = p[1 + j:1 + j + rows][:, draft_targets]                      # [rows, Vd]
        alpha[:rows, j] = step_acceptance(p_at, q[:rows].to(p_at.dtype)).cpu()
    return alpha.tolist()


def estimate_at_temperature(draft_dir: Path, target_path: Path, units: list[dict], max_k: int,
                            temperature: float, device: str, dtype: str, estimate_path: Path,
                            key: str, loaded: dict, label: str = "estimate",
                            trust_remote_code: bool = False,
                            draft_temperature: float | None = None) -> dict[str, dict]:
    """The offline estimate of acceptance at ``temperature`` on each of the target's sampled
    answers (``units``: ``[{"key", "prompt_token_ids", "output_token_ids"}]``): per answer,
    the expected walk (rejection_estimate.expected_acceptance) for every K in
    ``1..max_k``; ``draft_temperature``: as in :func:`temperature_alpha`. Kept in
    ``estimate_path`` by ``key`` like the replay (resume). Returns
    ``{unit key: {"by_k": {"K": walk}}}``."""
    def by_k(target, draft, aux_layer_ids, ids, prompt_len, torch_device):
        alpha = temperature_alpha(target, draft, aux_layer_ids, ids, max_k, temperature,
                                  torch_device, draft_temperature)
        return {str(k): expected_acceptance([a[:k] for a in alpha], prompt_len, len(ids))
                for k in range(1, max_k + 1)}

    return per_answer(draft_dir, target_path, units, device, dtype, estimate_path, key, loaded,
                       label, trust_remote_code, by_k)
