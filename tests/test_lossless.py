"""Losslessness that holds on a GPU: a first divergence at a numerical near-tie of the
target's own logits is reported apart; any other divergence fails (eval/agreement.py).
And the vLLM-version adaptation of the evaluation's engine options."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3flow.eval.agreement import (NEAR_TIE_ULPS, classify_divergence, compare_outputs, dtype_ulp,
                                       lossless_cell, lossless_text)
from eagle3flow.eval.aggregate import set_result
from eagle3flow.serving.vllm_runner import engine_arg_names, spec_engine_options


def test_dtype_ulp_is_the_spacing_of_the_dtype():
    assert dtype_ulp(1.0, "bfloat16") == 2.0 ** -7
    assert dtype_ulp(-3.0, "bfloat16") == 2.0 ** -6       # [2, 4): one more binade
    assert dtype_ulp(0.75, "float16") == 2.0 ** -11
    assert dtype_ulp(1.0, "float32") == 2.0 ** -23
    assert torch.tensor(1.0 + dtype_ulp(1.0, "bfloat16"), dtype=torch.bfloat16).item() != 1.0
    assert torch.tensor(1.0 + dtype_ulp(1.0, "bfloat16") / 4, dtype=torch.bfloat16).item() == 1.0
    with pytest.raises(ValueError, match="int8"):
        dtype_ulp(1.0, "int8")


def test_classify_divergence_needs_the_top_two_and_a_gap_within_the_threshold():
    ulp = dtype_ulp(8.0, "bfloat16")
    top = [[1, 8.0], [2, 8.0 - NEAR_TIE_ULPS * ulp]]
    assert classify_divergence(top, 1, 2, "bfloat16")["near_tie"]
    assert classify_divergence(top, 2, 1, "bfloat16")["gap_ulps"] == NEAR_TIE_ULPS
    wider = [[1, 8.0], [2, 8.0 - (NEAR_TIE_ULPS + 1) * ulp]]
    assert not classify_divergence(wider, 1, 2, "bfloat16")["near_tie"]
    assert not classify_divergence(top, 1, 3, "bfloat16")["near_tie"], "not the runner-up"
    assert not classify_divergence(top, 1, 2, "float32")["near_tie"], "float32 resolves the gap"


def test_near_tie_in_the_engines_logits_passes_apart_and_a_real_mismatch_fails():
    """Prompt + 2 common tokens, then the runs part. Where the speculative run took the
    token the baseline engine scored 2 bf16 ulps below its greedy one, that is a near-tie
    (passes, counted); a runner-up 40 ulps below, a token outside the top two, or a
    baseline without recorded logits, is a real mismatch. (That the recorded logits are
    the target's own: tests/test_evaluate.py::test_vllm_runner_subprocess_greedy.)"""
    prompt, common, greedy, other = [5, 17, 42, 9], [88, 23], 11, 12
    ulp = dtype_ulp(9.5, "bfloat16")

    def top_logits(n: int, runner_up_gap_ulps: float) -> list:
        # the engine's two best [token, logit] per position, best first
        return ([[[t, 9.0], [other, 1.0]] for t in common] + [[[greedy, 9.5], [300, 9.5 - runner_up_gap_ulps * ulp]]]
                + [[[7, 3.0], [8, 2.0]]] * (n - 3))

    base = [{"id": "tie", "prompt_token_ids": prompt, "output_token_ids": common + [greedy, 7, 7],
             "top_logits": top_logits(5, 2)},
            {"id": "far", "prompt_token_ids": prompt, "output_token_ids": common + [greedy, 7],
             "top_logits": top_logits(4, 40)},
            {"id": "outside", "prompt_token_ids": prompt, "output_token_ids": common + [greedy],
             "top_logits": top_logits(3, 1)},
            {"id": "same", "prompt_token_ids": prompt, "output_token_ids": common + [greedy],
             "top_logits": top_logits(3, 1)}]
    spec = [{"id": "tie", "output_token_ids": common + [300, 3]},
            {"id": "far", "output_token_ids": common + [300, 7]},
            {"id": "outside", "output_token_ids": common + [301]},
            {"id": "same", "output_token_ids": common + [greedy]}]
    judged = compare_outputs(base, spec, "bfloat16")
    assert judged["near_tie_ids"] == ["tie"] and judged["real_mismatch_ids"] == ["far", "outside"]
    assert judged["judged"] and not judged["passed"] and not judged["identical"]
    tie = judged["divergences"]["tie"]
    assert tie["position"] == 2 and tie["target_top2"] == [greedy, 300]
    assert tie["gap_ulps"] == pytest.approx(2, abs=0.01)
    assert judged["divergences"]["far"]["gap_ulps"] == pytest.approx(40, abs=0.1)
    assert judged["divergences"]["outside"]["gap_ulps"] is None
    assert lossless_text(judged) == "FAIL (2/4 real mismatches; 1/4 differ after a numerical near-tie)"

    only_tie = compare_outputs(base[:1] + base[3:], spec[:1] + spec[3:], "bfloat16")
    assert only_tie["passed"] and only_tie["num_near_ties"] == 1 and not only_tie["identical"]
    assert lossless_cell(only_tie) == "identical up to 1/2 near-ties"
    assert lossless_text(only_tie) == "PASS (1/2 differ after a numerical near-tie)"
    # The same divergence served in float32 is no near-tie: 2 bf16 ulps are 2^17 float32 ulps.
    assert not compare_outputs(base[:1], spec[:1], "float32")["passed"]
    # Unjudged (no logits recorded, or no serving dtype), every difference is a real mismatch.
    unrecorded = [{k: v for k, v in o.items() if k != "top_logits"} for o in base[:1]]
    assert compare_outputs(unrecorded, spec[:1], "bfloat16")["real_mismatch_ids"] == ["tie"]
    assert not compare_outputs(unrecorded, spec[:1], "bfloat16")["judged"]
    assert compare_outputs(base[:1], spec[:1])["real_mismatch_ids"] == ["tie"]


def test_a_speculative_output_cut_short_is_a_real_mismatch():
    base = [{"id": "a", "prompt_token_ids": [1], "output_token_ids": [4, 5, 6]}]
    spec = [{"id": "a", "output_token_ids": [4, 5]}]

    base[0]["top_logits"] = [[[4, 1.0], [5, 0.9]], [[5, 1.0], [6, 0.9]], [[6, 1.0], [5, 1.0]]]
    res = compare_outputs(base, spec, "bfloat16")
    assert not res["passed"] and res["first_divergence"] == {"a": 2} and res["divergences"] == {}
    assert not compare_outputs(base, [], "bfloat16")["passed"]


def test_spec_decode_metrics_asked_only_where_the_engine_has_them():
    """0.32 (installed) takes per_request_spec_decode_metrics; 0.25 has no such engine argument."""
    names = engine_arg_names()
    assert {"model", "speculative_config", "per_request_spec_decode_metrics"} <= names
    assert spec_engine_options(names) == {"per_request_spec_decode_metrics": "detailed"}
    assert spec_engine_options(names - {"per_request_spec_decode_metrics"}) == {}


def test_outputs_without_per_request_metrics_still_evaluate():
    """What a vLLM without per-request metrics returns: counters, no ``spec_decode`` per
    output. Acceptance and losslessness are there; round agreement is null, not wrong."""
    outputs = [{"id": "p0", "output_token_ids": [3, 4, 5, 6], "spec_decode": None},
               {"id": "p1", "output_token_ids": [7, 8], "spec_decode": None}]
    base_set = {"outputs": outputs, "num_output_tokens": 6, "output_tokens_per_s": 10.0, "wall_time_s": 0.6}
    spec_set = {**base_set, "output_tokens_per_s": 12.0,
                "spec_decode": {"num_drafts": 3, "num_draft_tokens": 6, "num_accepted_tokens": 3,
                                "num_accepted_tokens_per_pos": [2, 1]}}
    replays = {f"eval/{o['id']}": {"by_k": {str(k): {"rounds": 2, "accepted": 1, "accepted_per_pos": [1, 0][:k],
                                                     "per_round": [1, 0]} for k in (1, 2)}}
               for o in outputs}
    prompt_set = {"name": "eval", "category_of": {"p0": "a", "p1": "b"}}
    r = set_result(prompt_set, base_set, spec_set, replays, 2, 0.2)
    assert r["vllm"]["acceptance_length"] == 2.0 and r["lossless"]["passed"]
    assert r["round_agreement"] is None
    assert r["per_category"]["a"]["vllm_acceptance_length"] is None
    # Without the replay (evaluate.replay), vLLM's numbers and the lossless check stay.
    unreplayed = set_result(prompt_set, base_set, spec_set, None, 2, 0.2)
    assert unreplayed["vllm"] == r["vllm"] and unreplayed["lossless"] == r["lossless"]
    assert unreplayed["simulated"] is unreplayed["agreement"] is unreplayed["acceptance_length_vs_k"] is None
    assert unreplayed["per_category"]["a"]["replay_acceptance_length"] is None


# ----------------------------------------------------------------------------- at temperature

def _answers(rng, probs: list[float], prompts: int, n: int, length: int = 5) -> list[list[list[int]]]:
    """``prompts`` x ``n`` answers whose tokens are drawn i.i.d. from ``probs``."""
    import numpy as np

    return [[list(rng.choice(len(probs), size=length, p=np.array(probs))) for _ in range(n)]
            for _ in range(prompts)]


def test_distribution_test_false_alarm_rate_and_power_on_synthetic_samples():
    """Same distribution with and without the draft: flagged at most about alpha of the
    time. A draft that moves 20% of the mass (TV 0.2 per position) is caught at least 4 times in 5
    at the evaluation's default size (32 prompts x 8 samples, evaluate.samples_per_prompt)."""
    import numpy as np

    from eagle3flow.eval.distribution_test import distribution_test

    rng = np.random.default_rng(0)
    same = [0.5, 0.3, 0.15, 0.05]
    trials, alpha = 100, 0.05
    alarms = sum(not distribution_test(_answers(rng, same, 32, 4), _answers(rng, same, 32, 4),
                                       false_alarm_rate=alpha, permutations=199, seed=i)["passed"]
                 for i in range(trials))
    # Binomial(100, 0.05): 12 or more alarms has probability < 0.5%.
    assert alarms <= 12, alarms
    moved = [0.3, 0.3, 0.15, 0.25]
    caught = sum(not distribution_test(_answers(rng, same, 32, 8), _answers(rng, moved, 32, 8),
                                       false_alarm_rate=0.01, permutations=199, seed=i)["passed"]
                 for i in range(20))
    assert caught >= 16, caught      # power >= 0.8 at alpha 0.01


def test_distribution_test_counts_an_ended_answer_and_names_itself():
    from eagle3flow.eval.distribution_test import TEST_NAME, distribution_test

    # Every answer without the draft has 3 tokens; every one with it ends after 1.
    result = distribution_test([[[1, 2, 3]] * 8] * 6, [[[1]] * 8] * 6, positions=3,
                               false_alarm_rate=0.01, permutations=199)
    assert not result["passed"] and result["p_value"] == pytest.approx(1 / 200)
    assert result["statistic"] == pytest.approx(6 * 2 * 2)   # squared L2 2 at positions 1, 2
    # Position 0 (the prefill's token) is not compared: it is the same with either seed.
    assert distribution_test([[[1, 5]] * 4] * 3, [[[2, 5]] * 4] * 3)["statistic"] == pytest.approx(0)
    assert result["test"] == TEST_NAME and result["num_samples"] == 96
    same = distribution_test([[[1, 2]] * 4] * 3, [[[1, 2]] * 4] * 3)
    assert same["passed"] and same["statistic"] == pytest.approx(0) and same["p_value"] == 1.0
    nothing = distribution_test([[]], [[]])
    assert not nothing["passed"] and nothing["p_value"] is None     # nothing compared: no pass
    with pytest.raises(ValueError, match="false_alarm_rate"):
        distribution_test([[[1]]], [[[1]]], false_alarm_rate=0)


def test_cpu_expand_kernel_fix_probes_before_it_replaces():
    """The CPU build's expand kernel (the per-request temperature of the rejection sampler)
    is replaced only where it leaves a float output unwritten; the replacement expands."""
    pytest.importorskip("vllm")
    from eagle3flow.serving.vllm_cpu_fixes import _expand_in_torch, expand_kernel_is_broken

    assert not expand_kernel_is_broken(_expand_in_torch)
    out = torch.zeros(5)
    _expand_in_torch(out, torch.tensor([0.7, 0.0]), torch.tensor([2, 5]), 0, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0])   # greedy (0) read as 1
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        current_platform.import_kernels()      # _C_AVX2 on a CPU without AVX-512 (vllm._C: SIGILL)
        from vllm.utils import cpu_triton_utils
        # vLLM 0.32's: a later vLLM that fixes it makes this fail, and the fix can go.
        assert expand_kernel_is_broken(cpu_triton_utils._expand_kernel_impl)
