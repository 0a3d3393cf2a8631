"""Config values reach the stages' command lines as the arguments they are: a dry run
that prints every shell command (`snakemake -n -p`) with hostile values, each command
split as the shell splits it."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from eagle3flow.config import TRAIN_ONLY_WHEN_SET
from support.fault_rows import record, yes
from support.workflow import snakemake, workflow_copy

# Each would split into several arguments or run a command if it reached the shell as is.
HOSTILE = {
    "paths": {"results": "res ults/$(touch PWNED)", "cache": "ca che;touch PWNED", "logs": "lo gs`touch PWNED`"},
    "hub": {"base_model": "org/x $(touch PWNED)", "repo_id": "me/d; touch PWNED"},
    "evaluate": {"vllm_python": "/opt/vllm env/bin/python; touch PWNED"},
    "dataset": {"chat_template_kwargs": {"note": "it's $(touch PWNED)"}},
    "drain": {"unit": "vllm.service"},   # local-8gpu drains: it refuses to run without a unit
}
HOSTILE_STRINGS = [*HOSTILE["paths"].values(), HOSTILE["hub"]["base_model"], HOSTILE["hub"]["repo_id"],
                   HOSTILE["evaluate"]["vllm_python"], HOSTILE["dataset"]["chat_template_kwargs"]["note"]]


def printed_commands(output: str) -> list[list[str]]:
    """Every shell command of a `snakemake -n -p` run, as the shell splits it."""
    return [shlex.split(line.removeprefix("Shell command: ")) for line in output.splitlines()
            if line.startswith("Shell command: ") and line != "Shell command: None"]


def dry_run(tmp_path: Path, profile: str, config: dict, *targets: str):
    workdir = workflow_copy(tmp_path / "wf")
    (workdir / "hostile.json").write_text(json.dumps(config))
    configfiles = [str(p) for p in sorted((workdir / "profiles").glob(f"{profile}/workflow.yaml"))]
    if profile == "embedded-regenerate":
        configfiles.insert(0, "profiles/embedded/workflow.yaml")
    return workdir, snakemake(workdir, "-n", "-p", "--forceall", "--profile", f"profiles/{profile}",
                              *targets, "--configfile", *configfiles, "hostile.json", timeout=300)


def value_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def path_after(argv: list[str], flag: str) -> str:
    """The path after ``flag``, without the format export's --out-dir names first (eagle3=DIR)."""
    value = value_after(argv, flag)
    return value.split("=", 1)[1] if value.startswith(("eagle3=", "speculators=")) else value


@pytest.mark.parametrize("profile, targets", [("embedded-regenerate", ("all", "publish_draft")),
                                              ("local-8gpu", ())])
def test_hostile_config_values_reach_every_command_as_one_argument(tmp_path, profile, targets):
    workdir, result = dry_run(tmp_path, profile, HOSTILE, *targets)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    commands = printed_commands(result.stdout)
    modules = {argv[i + 1] for argv in commands for i, arg in enumerate(argv) if arg == "-m"}
    expected = {"eagle3flow.data.dataset", "eagle3flow.extract", "eagle3flow.train.launch", "eagle3flow.eval.evaluate",
                "eagle3flow.report.render", "eagle3flow.export.checkpoint"}
    if profile == "local-8gpu":
        expected.add("eagle3flow.ops.drain.service")
    else:
        expected |= {"eagle3flow.data.regenerate", "eagle3flow.data.compare_answers", "eagle3flow.export.publish",
                     "eagle3flow.report.model_card"}
    # What the shell would have split or run: a hostile value cut apart, a file it made.
    cut = [arg for argv in commands for arg in argv
           if "PWNED" in arg and not any(value in arg for value in HOSTILE_STRINGS)]
    made = list(workdir.rglob("PWNED"))
    record(scenario=f"config values with spaces and shell metacharacters ({profile})",
           fault_at="paths.*, hub.*, evaluate.vllm_python, a chat-template kwarg: `snakemake -n -p` of every rule",
           unit_healthy="not touched (dry run)", downtime="-", foreign_killed=0, recomputed=0, consistent="-",
           notes=f"{len(commands)} shell commands, {len(modules)} stage modules; values cut apart: {len(cut)}; "
                 f"files the values would have made: {len(made)}")
    assert expected <= modules, modules
    assert cut == [] and made == [], (cut, made)
    for argv in commands:
        assert "" not in argv, f"a flag without its value: {argv}"
        for arg in argv:
            if "PWNED" in arg:
                assert any(value in arg for value in HOSTILE_STRINGS), (arg, argv)
            if arg.startswith(("{", "[")):
                json.loads(arg)
        for flag in ("--out-dir", "--log", "--manifest", "--cache-root", "--record", "--out"):
            if flag in argv:
                assert path_after(argv, flag).startswith(tuple(HOSTILE["paths"].values())), (flag, argv)
        if "--vllm-python" in argv:
            assert value_after(argv, "--vllm-python") == HOSTILE["evaluate"]["vllm_python"]
        # a stage's settings: its config section, each value as it was given
        settings = json.loads(value_after(argv, "--config-json")) if "--config-json" in argv else {}
        # target.trust_remote_code off: not in any command (they stay what they were, so
        # a run made before it was a key of --config-json reruns nothing)
        assert "trust_remote_code" not in settings, argv
        # nor train.loss and its settings at their defaults (train runs cached before them rerun nothing)
        assert not set(settings) & set(TRAIN_ONLY_WHEN_SET), argv
        for section, values in HOSTILE.items():
            for key, value in values.items():
                if key in settings and section != "paths":
                    assert settings[key] == value, (key, argv)
        # every command's log, with the pipe into it left to the shell
        if "tee" in argv:
            assert argv[argv.index("tee") - 1] == "|"
            assert value_after(argv, "tee").startswith(HOSTILE["paths"]["logs"] + "/")
    assert not list(workdir.rglob("PWNED"))


# Launchers in front of a stage: their own flags say how the stage runs (its GPUs, the
# drain, the processes), and the stage's command follows their "--".
LAUNCHERS = {"eagle3flow.ops.drain.gpu_stage", "eagle3flow.train.launch"}
# Flags that say which job of a rule this is (its wildcards, its stage, the cores and GPUs
# the scheduler gave it, whether the unit is drained for it), not a setting of the config.
JOB_FLAGS = {"--partition", "--split-name", "--stage", "--cores", "--gpus", "--drain"}
# The stages that load the target, and so take target.trust_remote_code in their --config-json.
LOADS_TARGET = {"eagle3flow.data.dataset", "eagle3flow.extract", "eagle3flow.data.regenerate",
                "eagle3flow.eval.evaluate", "eagle3flow.report.model_card"}


def shell_syntax(arg: str) -> bool:
    """Where a command's arguments end: a pipe, a list operator, a redirection."""
    return arg in {"|", "||", "&&", ";"} or arg.startswith((">", "2>", "<"))


def stage_commands(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``(module, its arguments)`` of every ``python -m eagle3flow...`` in one shell command:
    a launcher's arguments end at its "--" (the trainer's module, given without -m, and its
    arguments after it count as a stage of their own), a stage's at the shell's syntax."""
    def end_of(j, launcher):
        while j < len(argv) and not shell_syntax(argv[j]) and not (launcher and argv[j] == "--"):
            j += 1
        return j

    out, i = [], 0
    while i < len(argv):
        if argv[i] == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("eagle3flow."):
            module = argv[i + 1]
            j = end_of(i + 2, module in LAUNCHERS)
            args = argv[i + 2:j]
            if module == "eagle3flow.train.launch":   # ... --config-json {...} eagle3flow.train.trainer -- ARGS
                trainer = next(a for a in args if a.startswith("eagle3flow."))
                args = args[:args.index(trainer)]
                k = end_of(j + 1, False)
                out.append((trainer, argv[j + 1:k]))
                j = k
            out.append((module, args))
            i = j
        else:
            i += 1
    return out


def flags_of(args: list[str]) -> list[tuple[str, list[str]]]:
    """``(flag, its values)`` in order: the words up to the next flag (none: a switch;
    several: a list flag, as render's --manifest). Words before the first flag are a
    subcommand (``shards merge``)."""
    flags, i = [], 0
    while i < len(args) and not args[i].startswith("--"):
        assert args[i].isidentifier(), f"a positional argument: {args[i]!r} in {args}"
        i += 1
    for arg in args[i:]:
        if arg.startswith("--"):
            flags.append((arg, []))
        else:
            flags[-1][1].append(arg)
    return flags


def is_path(value: str, roots=("results", "cache", "logs")) -> bool:
    """An artifact path (with a directory part, or one of the run's folders ``roots``; the
    format export's --out-dir names its format first, eagle3=DIR), not a setting's value."""
    if value.startswith(("{", "[")):
        return False
    path = value.split("=", 1)[1] if value.startswith(("eagle3=", "speculators=")) else value
    return "/" in path or path in roots


@pytest.mark.parametrize("profile, targets", [("embedded", ("all", "publish_draft")),
                                              ("embedded-regenerate", ("all", "publish_draft")),
                                              ("local-8gpu", ())])
def test_every_stage_command_takes_path_flags_and_one_config_json(tmp_path, profile, targets):
    """The stage CLI convention, checked on every command a dry run prints with
    target.trust_remote_code on (the setting that was a flag of its own): each stage takes
    artifact paths as flags, its settings as at most one --config-json, and nothing else but
    the flags that name its job; every stage that loads the target has trust_remote_code in
    that JSON."""
    config = {"target": {"trust_remote_code": True}, "drain": {"unit": "vllm.service"},
              "train": {"loss": {"forward_kl": 0.5, "nla": 0.5}, "loss_temperature": 0.6}}
    workdir, result = dry_run(tmp_path, profile, config, *targets)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    seen: dict[str, set[str]] = {}
    for argv in printed_commands(result.stdout):
        for module, args in stage_commands(argv):
            flags = flags_of(args)
            names = [flag for flag, _ in flags]
            assert names.count("--config-json") <= 1, (module, args)
            if "--config-json" in names:
                assert len(dict(flags)["--config-json"]) == 1, (module, args)
            others = {flag for flag, values in flags if flag != "--config-json" and flag not in JOB_FLAGS
                      and not (values and all(map(is_path, values)))}
            seen[module] = seen.get(module, set()) | others
            if module in LOADS_TARGET:
                settings = json.loads(dict(flags)["--config-json"][0])
                assert settings.get("trust_remote_code") is True, (module, args)
            if module == "eagle3flow.train.trainer":
                trainer = json.loads(dict(flags)["--config-json"][0])
                assert (trainer["loss"], trainer["loss_temperature"]) == (config["train"]["loss"], 0.6), args
                assert "lk_hybrid_eta" not in trainer, args     # at its default
    assert LOADS_TARGET <= set(seen) or profile != "embedded-regenerate", sorted(seen)
    assert not any(seen.values()), {module: flags for module, flags in seen.items() if flags}


@pytest.mark.parametrize("section", ["extract", "train", "evaluate"])
def test_a_device_that_names_no_device_is_refused_naming_its_key(tmp_path, section):
    workdir, result = dry_run(tmp_path, "embedded", {section: {"device": "cuda; touch PWNED"}})
    output = result.stdout + result.stderr
    record(scenario=f"a device with shell metacharacters ({section}.device: `cuda; touch PWNED`)",
           fault_at="the schema check when the workflow is read", unit_healthy="not touched (refused before any job)",
           downtime="-", foreign_killed=0, recomputed=0, consistent="-",
           notes=f"snakemake rc={result.returncode}, refusal names {section}.device: "
                 f"{yes(f'{section}.device' in output)}; files made: {len(list(workdir.rglob('PWNED')))}")
    assert result.returncode != 0, output[-4000:]
    assert "cuda; touch PWNED" in output and f"{section}.device" in output, output[-4000:]
    assert not list(workdir.rglob("PWNED"))


def test_a_results_path_with_a_space_works(tmp_path):
    """A job run for real where paths.results and paths.logs hold spaces."""
    workdir = workflow_copy(tmp_path / "wf")
    config = {"paths": {"results": "my results", "logs": "my logs"}, "dataset": {"builtin_prompts": 4}}
    (workdir / "spaces.json").write_text(json.dumps(config))
    result = snakemake(workdir, "--profile", "profiles/smollm2", "--cores", "1", "my results/prompts/builtin_prompts.jsonl",
                       "--configfile", "profiles/smollm2/workflow.yaml", "spaces.json", timeout=300)
    out = workdir / "my results" / "prompts" / "builtin_prompts.jsonl"
    prompts = out.read_text().splitlines() if out.exists() else []
    log = workdir / "my logs" / "write_builtin_prompts.log"
    record(scenario="paths with spaces, run for real (paths.results: `my results`, paths.logs: `my logs`)",
           fault_at="a real job writing under both", unit_healthy="not touched (no GPU stage)", downtime="-",
           foreign_killed=0, recomputed=0, consistent="-",
           notes=f"snakemake rc={result.returncode}; its output has {len(prompts)}/4 prompts; its log in `my logs/`: "
                 f"{yes(log.is_file())}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert len(prompts) == 4
    assert log.is_file()
