"""What the tests share, by role; no test module imports another.

    processes.py     is a pid alive, which pids are still in a session
    targets.py       random Llama targets and chat tokenizers, made offline in seconds
    tiny_targets.py  tiny random targets of production architectures (DeepSeek-V3 / Kimi)
    kimi_target.py   a Kimi-K2.5-layout target: wrapper config, remote tokenizer, vision tower, INT4
    kimi_vllm.py     vLLM engines on such targets, run as a script
    builders.py      datasets, hidden-state manifests, vocab maps, trained-draft dirs, exports
    workflow.py      a copy of the workflow and Snakemake run in it
    box.py           the fake production node of the drain tests (FakeBox) and its workflow run
    report_checks.py checks of a `snakemake --report` HTML file, rendered in Chromium
    error_proxy.py   an HTTP proxy that fails chosen requests, run as a script

tests/conftest.py puts tests/ on sys.path, so these import as ``support.<module>``.
"""
