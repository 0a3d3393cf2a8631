"""The preflight: everything that can be checked without a GPU, before any drain.

On a box whose production vLLM unit holds the GPUs, every GPU stage first stops that unit,
and loading a large target takes ~25 min: a mistake found then has already cost the
service its downtime. So every ``drain_service`` job waits for a job of rule
``preflight_before_drain`` (rules/preflight.smk) that runs this as soon as the target and
the dataset exist (``snakemake preflight`` runs it alone). It reports every problem at once:

* the config: the schema (its bounds), the combinations no run can finish
  (eagle3flow/config.py, e.g. drain.unit unset while draining), ``train.draft``'s keys.
  The workflow checks these when it is read too, so ``snakemake -n`` and
  ``python -m eagle3flow.ops.plan`` already refuse them;
* the target directory: ``config.json``, every weight file whole
  (eagle3flow/target/files.py), the code it ships against ``target.trust_remote_code``
  (eagle3flow/target/remote_code.py), the aux layer ids within its layers, and the draft
  config built from it with ``train.draft``'s overrides;
* the tokenizer, loaded as the stages load it (eagle3flow/target/tokenizer.py), and its
  chat template rendering and masking a conversation of the dataset as prepare_dataset
  does (a Hub dataset is not read here: a probe conversation stands in).

It loads no model and uses no GPU. CLI::

    python -m eagle3flow.data.preflight --config-json '<the resolved config>' --target DIR \\
        --dataset PATH --out results/preflight/ok.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from eagle3flow.atomic import write_json
from eagle3flow.config import check_workflow_config, schema_problems
from eagle3flow.data.chat_masks import ChatMasker
from eagle3flow.data.records import BadRow, conversation_from_record
from eagle3flow.data.sources import load_sources, resolve_input
from eagle3flow.layers import resolve_aux_layer_ids
from eagle3flow.model.config import DraftConfig, check_override_keys
from eagle3flow.model.dflash_config import DFlashConfig
from eagle3flow.target.config import load_target_config
from eagle3flow.target.files import weight_problems
from eagle3flow.target.remote_code import check_remote_code, remote_code_files
from eagle3flow.target.tokenizer import load_tokenizer

# Stands in for the dataset's rows where none can be read here (a Hub dataset).
PROBE = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]
# Rows tried for a usable conversation before the dataset is called unusable here.
ROWS_TRIED = 100


class PreflightError(ValueError):
    """The run would fail after the drain: every problem found, one per line."""


def config_problems(config: dict) -> list[str]:
    """The checks of the workflow's config alone (also run when the workflow is read)."""
    problems = schema_problems(config)
    for check, value in ((check_workflow_config, config), (check_override_keys, config["train"]["draft"])):
        try:
            check(value)
        except ValueError as error:
            problems.append(str(error))
    return problems


def target_problems(config: dict, target: Path) -> list[str]:
    """The target directory: its config, weights, code, and what the config asks of it."""
    if not target.is_dir():
        return [f"target.path: {target} is not a directory"]
    problems = weight_problems(target)
    try:
        check_remote_code(target, config["target"]["trust_remote_code"])
    except ValueError as error:
        problems.append(str(error))
    try:
        text = load_target_config(target)
    except (OSError, ValueError) as error:
        return problems + [str(error)]
    try:
        dflash = config["dflash"]
        aux = resolve_aux_layer_ids(config["extract"]["aux_layer_ids"], int(text["num_hidden_layers"]),
                                    config["train"]["method"], dflash["num_hidden_layers"])
        if config["train"]["method"] == "dflash":
            # the default mask row needs the tokenizer; the extraction and training check it
            mask = dflash["mask_token_id"] if dflash["mask_token_id"] is not None else 0
            DFlashConfig.from_target_config(text, dflash["block_size"], mask, dflash["num_hidden_layers"],
                                            aux, dflash["draft"])
        else:
            vocab = min(int(config["vocab"]["draft_vocab_size"]), int(text["vocab_size"]))
            DraftConfig.from_target_config(text, aux, vocab, config["train"]["draft"])
    except KeyError as error:
        problems.append(f"{target / 'config.json'}: no {error} (the draft is derived from it)")
    except (TypeError, ValueError) as error:   # aux ids out of range, a bad train.draft/dflash value
        problems.append(f"{target / 'config.json'}: {error}")
    return problems


def first_conversation(dataset: str, fmt: str) -> tuple[str, list[dict]] | None:
    """(where, messages) of the first usable row of a local dataset; None for a Hub id."""
    if resolve_input(dataset) is None:
        return None
    source = load_sources(dataset, fmt)[0]
    for i in range(min(len(source.rows), ROWS_TRIED)):
        try:
            messages = conversation_from_record(source.rows[i], source.format, answer_prompts=True)
        except BadRow:
            continue
        # A prompt-only row (the target answers it, regenerate) gets a stand-in answer,
        # so the template's assistant turns are masked as they will be.
        return (f"{source.name} row {i}",
                [{**m, "content": m["content"] or "Hello!"} if m["role"] == "assistant" else m
                 for m in messages])
    raise ValueError(f"{source.name}: none of its first {ROWS_TRIED} rows is a usable conversation")


def tokenizer_problems(config: dict, target: Path, dataset: str | None) -> tuple[list[str], dict]:
    """The tokenizer as the stages load it, and the chat template on one conversation."""
    try:
        tokenizer = load_tokenizer(target, config["target"]["trust_remote_code"])
        masker = ChatMasker(tokenizer, config["dataset"]["chat_template_kwargs"])
    except (OSError, ValueError) as error:
        return [f"tokenizer: {error}"], {}
    try:
        found = first_conversation(dataset, config["dataset"]["format"]) if dataset else None
    except (OSError, ValueError) as error:   # DatasetError and unreadable files
        return [f"dataset.path: {error}"], {}
    where, messages = found or ("a probe conversation (the dataset is read by prepare_dataset)", PROBE)
    try:
        input_ids, loss_mask = masker.tokenize(messages, where)
    except Exception as error:   # the template is the target's code: any error is its answer
        return [f"chat template of {target} on {where}: {type(error).__name__}: {error}"], {}
    return [], {"rendered": where, "tokens": int(len(input_ids)), "loss_tokens": int(loss_mask.sum()),
                "tokenizer": type(tokenizer).__name__}


def preflight(config: dict, target: str | os.PathLike, dataset: str | None = None) -> dict:
    """Every check; returns what was checked, or raises :class:`PreflightError` with every problem."""
    target = Path(target)
    problems = config_problems(config) + target_problems(config, target)
    # A target whose code may not run has had its refusal: its tokenizer would repeat it.
    loads = target.is_dir() and (config["target"]["trust_remote_code"] or not remote_code_files(target))
    found, rendered = tokenizer_problems(config, target, dataset) if loads else ([], {})
    problems += found
    if problems:
        raise PreflightError(f"{len(problems)} problem(s), found before any drain:\n"
                             + "\n".join(f"  - {p}" for p in problems))
    return {"target": str(target), "trust_remote_code": bool(config["target"]["trust_remote_code"]),
            "drain_unit": config["drain"]["unit"] if config["drain"]["enabled"] else None, **rendered}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3flow.data.preflight", description=__doc__.split("\n")[0])
    parser.add_argument("--config-json", type=json.loads, required=True, help="the resolved workflow config")
    parser.add_argument("--target", required=True, help="the target directory the stages load")
    parser.add_argument("--dataset", default=None, help="the dataset the stages read (file, directory or Hub id)")
    parser.add_argument("--out", required=True, type=Path, help="ok.json, written only when every check passed")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")   # never hang on a network that is not there
    try:
        result = preflight(args.config_json, args.target, args.dataset)
    except PreflightError as error:
        print(f"preflight: {error}", file=sys.stderr, flush=True)
        return 1
    write_json(args.out, result)
    print(f"preflight: ok ({args.target}; {result.get('rendered')}: {result.get('tokens')} tokens, "
          f"{result.get('loss_tokens')} trained) -> {args.out}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
