"""The draft's model card: ``results/draft/README.md``, ready for the Hugging Face Hub.

YAML metadata (``base_model``, ``library_name``, ``tags``, ``pipeline_tag``), then what a
user needs to serve the draft and to judge it: the vLLM and SGLang command lines with the
speculative settings, the aux layer ids in both conventions, the draft vocabulary and
its coverage, the training data and budget, and the run's evaluation (acceptance length
and acceptance per draft position in vLLM for every prompt set, and the exact replay's
acceptance length for every K), plus anything that keeps an engine from serving the draft
as trained (eagle3flow/export/sglang_contract.py).

CLI::

    python -m eagle3flow.report.model_card --draft results/draft --eval-summary results/eval/summary.json \\
        --vocab-stats results/vocab/stats.json --dataset-stats results/dataset/stats.json \\
        --train-eval results/train/eval.json --target DIR --out results/draft/README.md \\
        --config-json '{"base_model": "org/name", "trust_remote_code": true}'

--config-json: the hub section's base_model (null: the target's own record of its Hub id,
else its directory's name) and target.trust_remote_code (the card says the run trusted
the target's code, and its serving commands pass vLLM's and SGLang's --trust-remote-code).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from safetensors import safe_open

from eagle3flow.atomic import write_text
from eagle3flow.config import MODEL_CARD_BORROWED, cli_settings
from eagle3flow.eval.temperature_table import temperature_note, temperature_rows
from eagle3flow.eval.agreement import NEAR_TIE_RULE, lossless_cell
from eagle3flow.layers import to_layer_outputs
from eagle3flow.model.dflash_config import DFLASH_ARCHITECTURE
from eagle3flow.export.sglang_contract import sglang_problems
from eagle3flow.target.config import read_config_file


def _num(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def evaluation_lines(summary: dict) -> list[str]:
    """The evaluation tables of the run (main draft): vLLM per prompt set, replay vs K."""
    main = summary["main_draft"]
    k = summary["settings"]["num_speculative_tokens"]
    lines = [f"Greedy decoding, {summary['settings']['max_tokens']} output tokens per prompt, vLLM "
             f"{summary['settings']['vllm_version']} on {summary['settings']['device']} "
             f"({summary['settings']['dtype']}), K = {k} speculative tokens. Acceptance length = 1 + accepted "
             "draft tokens per verification step (vLLM's own spec-decode counters); the replay is this "
             "project's exact simulation of greedy speculative decoding on vLLM's outputs.", ""]
    rows = []
    for name, by_draft in summary["results"].items():
        r = by_draft[main]
        src = summary["prompt_sets"][name]
        rows.append([name, str(src["num_prompts"]), _num(r["vllm"]["acceptance_length"]),
                     " / ".join(_num(a, ".2f") for a in r["vllm"]["acceptance_rate_per_position"]),
                     _num((r["simulated"] or {}).get("acceptance_length")),
                     lossless_cell(r["lossless"])])
    lines += _table(["prompt set", "prompts", f"acceptance length (vLLM, K={k})",
                     "acceptance per position", "replay", "greedy outputs vs target alone"], rows)
    lines += ["", f"Greedy outputs: {NEAR_TIE_RULE}; a near-tie is counted apart and does not "
                  "fail the check, a real mismatch does."]
    max_k = summary["settings"].get("replay_max_k") or k
    replay = summary["settings"].get("replay") or {"run": True}
    if replay["run"]:
        lines += ["", "Acceptance length vs K (exact replay):", ""]
        lines += _table(["prompt set"] + [f"K={j}" for j in range(1, max_k + 1)],
                        [[name] + [_num(by_draft[main]["acceptance_length_vs_k"].get(str(j)))
                                   for j in range(1, max_k + 1)]
                         for name, by_draft in summary["results"].items()])
    else:
        lines += ["", f"The replay did not run ({replay['reason']}; `evaluate.replay`)."]
    lines += temperature_lines(summary)
    sweep = (summary.get("vllm_k_sweep_by_draft") or {})
    served = [[name, str(x), _num(v["acceptance_length"])] for name, by_draft in sweep.items()
              for x, v in sorted((by_draft.get(main) or {}).items(), key=lambda i: int(i[0]))]
    if served:
        lines += ["", "vLLM itself at more K:", ""] + _table(["prompt set", "K", "acceptance length"], served)
    return lines


def temperature_lines(summary: dict) -> list[str]:
    """Acceptance per temperature beside greedy (main draft), where the run sampled any."""
    note = temperature_note(summary)
    if note is None:
        return []
    main, k = summary["main_draft"], summary["settings"]["num_speculative_tokens"]
    rows = [[r["set"], "greedy" if r["temperature"] == 0 else f"{r['temperature']:g}",
             _num(r["acceptance_length"]),
             "" if r["ci_low"] is None else f"{_num(r['ci_low'])} - {_num(r['ci_high'])}",
             _num(r["offline"]) + ("" if r["offline_within_ci"] is None
                                   else (" (in interval)" if r["offline_within_ci"] else " (OUTSIDE interval)")),
             ("pass" if r["lossless_passed"] else "FAIL")
             + ("" if r["lossless_p_value"] is None else f" (p = {r['lossless_p_value']:.3f})")]
            for r in temperature_rows(summary) if r["draft"] == main]
    return ["", f"Acceptance per sampling temperature (vLLM, K={k}):", ""] + _table(
        ["prompt set", "temperature", "acceptance length", "interval", "offline estimate",
         "lossless"], rows) + ["", note]


def render(draft_dir: Path, summary: dict | None, vocab: dict, dataset: dict | None, train_eval: dict | None,
           base_model: str, trust_remote_code: bool = False) -> str:
    """The card. ``trust_remote_code``: the run had ``target.trust_remote_code`` on (the
    target ships its own code), so the serving commands need it too."""
    config = json.loads((draft_dir / "config.json").read_text())
    if DFLASH_ARCHITECTURE in config.get("architectures", []):
        lines = dflash_head(config, base_model, trust_remote_code)
    else:
        lines = eagle3_head(draft_dir, config, summary, vocab, base_model, trust_remote_code)
    if dataset:
        splits = dataset["splits"]
        regenerated = (dataset.get("regenerated") or {}).get("samples", 0)
        more = ((dataset.get("regenerated") or {}).get("more_answers") or {}).get("samples", 0)
        lines += ["## Training data", "",
                  f"{splits['train']['samples']:,} conversations ({splits['train']['tokens']:,} tokens) for training, "
                  f"{splits['eval']['samples']:,} held out; "
                  + (f"answers written by the target itself ({regenerated:,} regenerated"
                     + (f", and {more:,} further answers to training prompts" if more else "") + ")."
                     if regenerated else "the dataset's own answers."), ""]
    if train_eval and train_eval.get("method") == "dflash":
        accuracy = ", ".join(_num(a) for a in train_eval.get("slot_accuracy") or [])
        lines += [f"Trained {train_eval.get('steps')} steps; on the held-out split, per block slot, the draft's "
                  f"argmax equals the data's token at rates {accuracy}.", ""]
    elif train_eval:
        cfg = train_eval.get("train_config") or {}
        lines += [f"Trained {train_eval.get('steps')} steps ({cfg.get('epochs')} epochs of {cfg.get('batch_tokens')}-"
                  f"token batches, {cfg.get('ttt_steps')} TTT steps, {cfg.get('optimizer')} at lr {cfg.get('lr')}).", ""]
    if summary:
        lines += ["## Evaluation", ""] + evaluation_lines(summary) + [""]
    return "\n".join(lines) + "\n"


def dflash_head(config: dict, base_model: str, trust_remote_code: bool) -> list[str]:
    """The card's front matter, serving and inputs sections for a DFlash draft."""
    k = int(config["block_size"]) - 1
    layers = config["dflash_config"]["target_layer_ids"]
    trust = " --trust-remote-code" if trust_remote_code else ""
    lines = ["---", f"base_model: {base_model}", "library_name: vllm", "pipeline_tag: text-generation", "tags:",
             "- speculative-decoding", "- dflash", "- eagle3flow", "- draft-model", "---", "",
             f"# DFlash draft for {base_model}", "",
             f"A {config['num_hidden_layers']}-layer DFlash block draft ({DFLASH_ARCHITECTURE}) trained on "
             f"{base_model}'s own hidden states by eagle3flow: it proposes a block of {k} tokens in one forward "
             "pass. It speculates for that target only: the target verifies every token, so outputs are the "
             "target's.", "", "## Serve it", ""]
    if trust_remote_code:
        lines += [f"{base_model} ships its own code (`auto_map`): the engine needs `--trust-remote-code`.", ""]
    return lines + [
        "vLLM:", "", "```bash", f"vllm serve {base_model}{trust} --speculative-config \\",
        f"  '{{\"method\": \"dflash\", \"model\": \"<this directory or repo>\", \"num_speculative_tokens\": {k}}}'",
        "```", "",
        "## What it reads and predicts", "",
        f"- Hidden states of the target's layers {layers} (outputs of those decoder layers, "
        "`dflash_config.target_layer_ids`), the target's embeddings and lm_head (shared at serving; not "
        "shipped).",
        f"- Blocks of {config['block_size']}: the verified token and {k} mask tokens "
        f"(`mask_token_id` {config['dflash_config']['mask_token_id']}), attended without a causal mask.", ""]


def eagle3_head(draft_dir: Path, config: dict, summary: dict | None, vocab: dict, base_model: str,
                trust_remote_code: bool) -> list[str]:
    """The card's front matter, serving and inputs sections for an EAGLE-3 draft."""
    with safe_open(str(draft_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    ids = config["eagle_aux_hidden_state_layer_ids"]
    k = summary["settings"]["num_speculative_tokens"] if summary else 3
    mla = config["architectures"][0] == "Eagle3DeepseekV2ForCausalLM"
    trust = " --trust-remote-code" if trust_remote_code else ""
    tags = ["speculative-decoding", "eagle3", "eagle3flow", "draft-model"] + (["mla"] if mla else [])
    lines = ["---", f"base_model: {base_model}", "library_name: vllm", "pipeline_tag: text-generation",
             "tags:"] + [f"- {t}" for t in tags] + ["---", "",
             f"# EAGLE-3 draft for {base_model}", "",
             f"A one-layer EAGLE-3 draft head ({config['architectures'][0]}) trained with training-time test on "
             f"{base_model}'s own hidden states by eagle3flow and exported as vLLM and "
             "SGLang load it. It speculates for that target only: the target verifies every token, so outputs "
             "are the target's.", "", "## Serve it", ""]
    if trust_remote_code:
        lines += [f"{base_model} ships its own code (`auto_map`): this draft was trained with "
                  "`target.trust_remote_code: true`, and the engines below need `--trust-remote-code` "
                  "to load the target.", ""]
    lines += ["vLLM:", "", "```bash",
              f"vllm serve {base_model}{trust} --speculative-config \\",
              f"  '{{\"method\": \"eagle3\", \"model\": \"<this directory or repo>\", \"num_speculative_tokens\": {k}}}'",
              "```", ""]
    problems = sglang_problems(config, names)
    if problems:
        lines += ["SGLang would not serve this draft as trained: " + "; ".join(problems) + ".", ""]
    else:
        lines += ["SGLang (0.5.23 or newer):", "", "```bash",
                  f"python -m sglang.launch_server --model-path {base_model}{trust} --speculative-algorithm EAGLE3 \\",
                  f"  --speculative-draft-model-path <this directory or repo> --speculative-num-steps {k} \\",
                  f"  --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}", "```", ""]
    coverage = vocab.get("coverage")
    lines += ["## What it reads and predicts", "",
              f"- Aux hidden states of target layers {ids} in vLLM's convention (the input of decoder layer k, "
              f"`eagle_aux_hidden_state_layer_ids`), i.e. the outputs of layers {to_layer_outputs(ids)} as "
              "SGLang and the EAGLE-3 paper count them (`eagle_config`).",
              f"- Draft vocabulary: {config.get('draft_vocab_size')} of the target's {config['vocab_size']} "
              f"tokens, covering {_num(100 * coverage if coverage is not None else None, '.2f')}% of the "
              f"assistant tokens of the training data (`d2t`/`t2d`).",
              f"- Architecture flags: " + (", ".join(f for f in ("norm_before_fc", "fc_norm", "norm_before_residual",
                                                                 "norm_output") if config.get(f)) or "none"), ""]
    return lines


def base_model_name(target: str, configured: str | None) -> str:
    """The Hub id to name: the configured one, else the target's own record of it, else its directory."""
    if configured:
        return configured
    try:
        config = read_config_file(target)
    except (OSError, ValueError):
        config = {}
    name = config.get("_name_or_path") or ""
    return name if name and not os.path.isabs(name) and not name.startswith(".") else Path(target).resolve().name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.report.model_card", description=__doc__.split("\n")[0])
    parser.add_argument("--draft", required=True, type=Path)
    parser.add_argument("--eval-summary", type=Path)
    parser.add_argument("--vocab-stats", required=True, type=Path)
    parser.add_argument("--dataset-stats", type=Path)
    parser.add_argument("--train-eval", type=Path)
    parser.add_argument("--target", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--config-json", default="{}", help="the hub section's base_model, and trust_remote_code")
    args = parser.parse_args(argv)
    hub = cli_settings(parser, "hub", args.config_json, borrowed=MODEL_CARD_BORROWED)
    read = lambda p: json.loads(p.read_text()) if p else None   # noqa: E731
    card = render(args.draft, read(args.eval_summary), read(args.vocab_stats), read(args.dataset_stats),
                  read(args.train_eval), base_model_name(args.target, hub["base_model"]),
                  trust_remote_code=hub["trust_remote_code"])
    write_text(args.out, card)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
