"""extract.aux_layer_ids as vLLM feeds them to the draft: ascending, each once, any count.

vLLM appends the aux hidden states in ascending layer order whatever the config lists,
so a draft trained on them in another order gets a permutation of its fc input at
serving time; and vLLM's Llama EAGLE-3 draft sizes fc from num_aux_hidden_states (else
eagle_config's ids, else 3). The ids are normalized when the workflow is read (before
any job), by the extraction CLI, and the exported config carries the count.
"""
from __future__ import annotations

import json
import pytest

from eagle3flow.model.config import DraftConfig
from eagle3flow.layers import resolve_aux_layer_ids
from support.workflow import snakemake, workflow_copy


def test_ids_are_sorted_and_deduplicated_with_a_notice(capsys):
    from eagle3flow.layers import normalize_aux_layer_ids

    assert resolve_aux_layer_ids([4, 0, 7, 2], 8) == [0, 2, 4, 7]
    assert "ascending layer order" in capsys.readouterr().err
    assert resolve_aux_layer_ids([2, 4, 4, 5], 8) == [2, 4, 5]
    assert "each layer once" in capsys.readouterr().err
    assert resolve_aux_layer_ids([2, 4, 5], 8) == [2, 4, 5] and not capsys.readouterr().err
    assert normalize_aux_layer_ids(None) == (None, None)
    with pytest.raises(ValueError, match="out of range for a target with 8 decoder layers"):
        resolve_aux_layer_ids([2, 8], 8)
    with pytest.raises(ValueError, match="empty"):
        normalize_aux_layer_ids([])


def vllm_fc_inputs(hf: dict) -> int:
    """How many target states vLLM's LlamaForCausalLMEagle3 sizes fc for (vllm 0.32,
    model_executor/models/llama_eagle3.py: num_aux_hidden_states, else
    len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3)."""
    count = hf.get("num_aux_hidden_states")
    if count is None:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        count = len(ids) if ids else 3
    return count


@pytest.mark.parametrize("ids", [[2, 4, 5], [0, 2, 4, 7], [0, 3], [1, 2, 3, 4, 5]])
def test_exported_config_sizes_fc_for_every_count(ids):
    cfg = DraftConfig(hidden_size=64, target_hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, intermediate_size=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=None, max_position_embeddings=512, vocab_size=512,
                      draft_vocab_size=40, aux_layer_ids=ids)
    hf = cfg.to_hf_config()
    assert vllm_fc_inputs(hf) == len(ids) and hf["eagle_aux_hidden_state_layer_ids"] == ids


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return workflow_copy(tmp_path_factory.mktemp("aux_ids") / "wf")


def with_ids(workdir, ids) -> list[str]:
    path = workdir / "ids.json"
    path.write_text(json.dumps({"extract": {"aux_layer_ids": ids}}))
    return ["--configfile", "profiles/embedded/workflow.yaml", str(path)]


def test_the_workflow_normalizes_the_ids_when_read(workdir):
    result = snakemake(workdir, "-n", "-p", "--profile", "profiles/embedded", *with_ids(workdir, [7, 2, 2, 4]),
                       timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "extract.aux_layer_ids [7, 2, 2, 4] -> [2, 4, 7]" in out, out[-3000:]
    assert '"aux_layer_ids": [2, 4, 7]' in out and '"aux_layer_ids": [7, 2' not in out


def test_out_of_range_ids_are_refused_before_any_job(workdir):
    """The embedded target has 8 decoder layers (its shape is known before it is built)."""
    result = snakemake(workdir, "-n", "--profile", "profiles/embedded", *with_ids(workdir, [2, 4, 30]),
                       timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "[30] out of range for a target with 8 decoder layers" in out, out[-3000:]
    assert not (workdir / "results").exists() and not (workdir / "logs").exists()
