"""Rules V14-V24: settings a run would ignore without a word, or refuse only once it has started.

Each rule has cases that break it (checked for the rule id, a distinctive part
of the message, the fields it names and a fix) and a close variant that is
clean of it. Then each rule once more through the command line, as a user
meets it: ``graphstep config validate`` and ``graphstep train`` both exit 2
with the same one violation line, before anything of the run is set up (the
check lives in validation only; training has no second copy of it).
"""

from __future__ import annotations

import re
import sys

import pytest

from graphstep.config import Config
from helpers.runs import graph_config
from graphstep.validation import format_violations, validate_config
from helpers.launch import ROOT



def make(*overrides: str) -> Config:
    """The graph-friendly baseline plus overrides (conftest.graph_config)."""
    return graph_config(*overrides)


def check(cfg: Config, world_size: int = 1):
    return validate_config(cfg, env={}, device_capability=(9, 0), world_size=world_size)


PROFILE = "profiling.use_pytorch_profiler=true"
MOE = ("model.num_moe_experts=4", "model.moe_router_topk=2")
MAMBA = ("model.hybrid_override_pattern=M*", "model.num_layers=2")

# name -> (rule, overrides that break it, part of the message, fields it must name, a clean variant, world size)
CASES: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...], tuple[str, ...], int]] = {
    "V14-corpus": ("V14", ("data.data_path=chat.jsonl",), "data.data_path=chat.jsonl is set but data.dataset=corpus "
                   "does not read it", ("data.data_path", "data.dataset"),
                   ("data.data_path=chat.jsonl", "data.dataset=sft"), 1),
    "V14-mock": ("V14", ("data.dataset=mock", "data.data_path=[/data/a_text_document]"), "data.dataset=mock does not "
                 "read it", ("data.data_path",), ("data.dataset=indexed", "data.data_path=[/data/a_text_document]"), 1),
    "V16-order": ("V16", (PROFILE, "profiling.profile_step_start=5", "profiling.profile_step_end=3"),
                  "profiling.profile_step_start=5, profiling.profile_step_end=3 with "
                  "profiling.use_pytorch_profiler=true", ("profiling.profile_step_start", "profiling.profile_step_end"),
                  ("profiling.profile_step_start=5", "profiling.profile_step_end=3"), 1),  # profiling off: no window
    "V16-zero": ("V16", ("profiling.use_nsys_profiler=true", "profiling.profile_step_start=0",
                         "profiling.profile_step_end=2"), "counted from 1", ("profiling.profile_step_start",),
                 ("profiling.use_nsys_profiler=true", "profiling.profile_step_start=1", "profiling.profile_step_end=2"),
                 1),
    "V16-beyond": ("V16", (PROFILE, "train.train_iters=5"), "but train.train_iters=5: none of them runs",
                   ("profiling.profile_step_end", "train.train_iters"), (PROFILE, "train.train_iters=12"), 1),
    "V16-short": ("V16", ("profiling.record_memory_history=true", "train.train_iters=11"),
                  "iteration 12 never run(s)", ("train.train_iters",),
                  ("profiling.record_memory_history=true", "train.train_iters=11", "profiling.profile_step_end=11"), 1),
    "V17": ("V17", (PROFILE, "profiling.profile_ranks=[0,2]"), "names rank(s) [2], but the run has 2 rank(s), 0..1",
            ("profiling.profile_ranks",), (PROFILE, "profiling.profile_ranks=[0,1]"), 2),
    "V17-one-rank": ("V17", ("profiling.use_nsys_profiler=true", "profiling.profile_ranks=[1]"),
                     "(no rank profiles)", ("profiling.profile_ranks",), ("profiling.profile_ranks=[1]",), 1),
    "V17-empty": ("V17", (PROFILE, "profiling.profile_ranks=[]"), "names no rank", ("profiling.profile_ranks",),
                  (PROFILE, "profiling.profile_ranks=[0]"), 1),
    "V18": ("V18", ("checkpoint.finetune=true",), "checkpoint.load=null (and no model.hf_path): nothing is loaded",
            ("checkpoint.finetune", "checkpoint.load"), ("checkpoint.finetune=true", "checkpoint.load=/ckpt/base"), 1),
    "V19": ("V19", ("model.cuda_graph_impl=full_iteration", "train.train_iters=3"),
            "model.cuda_graph_warmup_steps=3 eager iteration(s), but train.train_iters=3: no graph is ever captured",
            ("model.cuda_graph_warmup_steps", "train.train_iters"),
            ("model.cuda_graph_impl=full_iteration", "train.train_iters=4"), 1),
    "V19-per-layer": ("V19", ("model.cuda_graph_impl=local", "model.cuda_graph_warmup_steps=0", "train.train_iters=1"),
                      "per-layer graphs always run one eager iteration first",
                      ("model.cuda_graph_warmup_steps", "model.cuda_graph_impl"),
                      ("model.cuda_graph_impl=local", "model.cuda_graph_warmup_steps=0", "train.train_iters=2"), 1),
    "V19-eager": ("V19", ("model.cuda_graph_impl=transformer_engine", "train.train_iters=2"), "no graph is ever captured",
                  ("train.train_iters",), ("model.cuda_graph_impl=none", "train.train_iters=2"), 1),
    "V20": ("V20", ("logger.wandb_save_dir=runs/wandb",), "logger.wandb_save_dir=runs/wandb is ignored: W&B is off",
            ("logger.wandb_save_dir", "logger.wandb_project"),
            ("logger.wandb_save_dir=runs/wandb", "logger.wandb_project=p"), 1),
    "V20-name": ("V20", ("logger.wandb_exp_name=tiny", "logger.wandb_save_dir=runs/wandb"), "are ignored",
                 ("logger.wandb_exp_name", "logger.wandb_save_dir"), ("logger.wandb_exp_name=null",), 1),
    "V22-zero": ("V22", ("data.seq_length_buckets=[0,64,128]",), "has bucket(s) [0] outside 1..model.seq_length=128",
                 ("data.seq_length_buckets",), ("data.seq_length_buckets=[64,128]",), 1),
    "V22-long": ("V22", ("data.dataset=sft", "data.data_path=c.jsonl", "data.seq_length_buckets=[64,256]"),
                 "has bucket(s) [256] outside", ("data.seq_length_buckets", "model.seq_length"),
                 ("data.dataset=sft", "data.data_path=c.jsonl", "data.seq_length_buckets=[64,128]"), 1),
    "V22-fixed-length": ("V22", ("data.dataset=mock", "data.seq_length_buckets=[32,64]"), "data.dataset=mock samples "
                         "are all model.seq_length=128 tokens, longer than the largest bucket 64",
                         ("data.seq_length_buckets", "data.dataset"),
                         ("data.dataset=sft", "data.data_path=c.jsonl", "data.seq_length_buckets=[32,64]"), 1),
    "V22-empty": ("V22", ("data.seq_length_buckets=[]",), "holds no bucket", ("data.seq_length_buckets",),
                  ("data.seq_length_buckets=null",), 1),
    "V23-bias": ("V23", (*MOE, "model.moe_router_enable_expert_bias=true"), "added to sigmoid scores",
                 ("model.moe_router_enable_expert_bias", "model.moe_router_score_function"),
                 (*MOE, "model.moe_router_enable_expert_bias=true", "model.moe_router_score_function=sigmoid"), 1),
    "V23-pad": ("V23", (*MOE, "model.moe_pad_expert_input_to_capacity=true"), "there is no capacity to pad to",
                ("model.moe_pad_expert_input_to_capacity", "model.moe_expert_capacity_factor"),
                (*MOE, "model.moe_pad_expert_input_to_capacity=true", "model.moe_expert_capacity_factor=1.0"), 1),
    "V23-factor": ("V23", (*MOE, "model.moe_expert_capacity_factor=0.0"), "is not above 0",
                   ("model.moe_expert_capacity_factor",), (*MOE, "model.moe_expert_capacity_factor=0.5"), 1),
    "V24-head": ("V24", (*MAMBA, "model.mamba_head_dim=7"), "does not divide the Mamba inner width",
                 ("model.mamba_head_dim", "model.hidden_size"), (*MAMBA, "model.mamba_head_dim=8"), 1),
    "V24-groups": ("V24", (*MAMBA, "model.mamba_num_groups=3"), "does not divide the",
                   ("model.mamba_num_groups",), (*MAMBA, "model.mamba_num_groups=2"), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_reports_problem_and_fix(name: str) -> None:
    rule, bad, message, fields, good, world = CASES[name]
    found = [v for v in check(make(*bad), world) if v.rule == rule]
    assert len(found) == 1, format_violations(check(make(*bad), world))
    assert message in found[0].message, found[0]
    assert set(fields) <= set(found[0].fields) and found[0].fix.startswith(("set ", "drop ", "add ")), found[0]
    assert rule not in {v.rule for v in check(make(*good), world)}, format_violations(check(make(*good), world))


def test_every_documented_rule_from_v14_has_a_case() -> None:
    text = (ROOT / "docs" / "rules.md").read_text()
    documented = set(re.findall(r"^\| (V\d+) \|", text, re.M))
    retired = set(re.findall(r"^\| (V\d+) \| retired", text, re.M))
    assert retired == {"V15"}
    numbered = {rule for rule in documented - retired if int(rule[1:]) >= 14}
    assert numbered == {f"V{i}" for i in range(14, 25)} - retired
    assert numbered - {"V21"} == {case[0] for case in CASES.values()}  # V21 needs a missing package: below


def test_a_sharding_strategy_without_megatron_fsdp_is_accepted_as_megatron_does_and_said_in_the_log() -> None:
    # Megatron Bridge's pretraining recipes set optim_grads_params without Megatron FSDP; Megatron ignores it
    from graphstep.validation import accepted_notes

    for extra, now in (((), "hold whole replicas"), (("ddp.use_distributed_optimizer=true",), "ZeRO-2")):
        cfg = make("ddp.data_parallel_sharding_strategy=optim_grads_params", *extra)
        assert not check(cfg, 1), format_violations(check(cfg, 1))
        [note] = [n for n in accepted_notes(cfg) if n.startswith("ddp.data_parallel_sharding_strategy")]
        assert "takes effect only with ddp.use_megatron_fsdp=true" in note and now in note, note
    cfg = make("ddp.data_parallel_sharding_strategy=optim_grads_params", "ddp.use_megatron_fsdp=true")
    assert not [n for n in accepted_notes(cfg) if n.startswith("ddp.data_parallel_sharding_strategy")]


@pytest.mark.parametrize("field, module, extra", [
    ("logger.tensorboard_dir=runs/tb", "tensorboard", "tensorboard"),
    ("logger.wandb_project=p", "wandb", "wandb"),
], ids=["tensorboard", "wandb"])
def test_v21_a_field_whose_package_is_missing(monkeypatch, field, module, extra) -> None:
    key = field.split("=")[0]
    assert "V21" not in {v.rule for v in check(make(field))}  # installed here (the test extras)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    (found,) = [v for v in check(make(field)) if v.rule == "V21"]
    assert found.fields == (key,)
    assert found.message == f"{field} needs the {module} package, which is not installed."
    assert found.fix == f"pip install 'graphstep[{extra}]', or set {key}=null."
    assert "V21" not in {v.rule for v in check(make())}  # not asked for: not needed


@pytest.mark.parametrize("key", ["logger.tensorboard_log_interval", "ddp.bucket_size"])
def test_minimums_the_trainer_checked_late(key: str) -> None:
    (found,) = [v for v in check(make(f"{key}=0")) if key in v.fields]
    assert found.rule == "V" and f"{key}=0 is below 1" in found.message
    assert not [v for v in check(make(f"{key}=1")) if key in v.fields]


# --------------------------------------------------------------------------
# the command line: `config validate` and `train` refuse the same, with the same line

# rule -> overrides on `--recipe llama3_tiny` (full-iteration graphs, 200 iterations) that break it alone
CLI_CASES = {
    "V14": ["data.data_path=chat.jsonl"],
    "V16": [PROFILE, "profiling.profile_step_start=5", "profiling.profile_step_end=3"],
    "V16-beyond": [PROFILE, "train.train_iters=8"],
    "V17": [PROFILE, "profiling.profile_ranks=[2]"],
    "V18": ["checkpoint.finetune=true"],
    "V19": ["train.train_iters=2"],
    "V20": ["logger.wandb_save_dir=runs/wandb"],
    "V21": ["logger.tensorboard_dir=runs/tb"],
    "V22": ["data.seq_length_buckets=[0,128]"],
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_config_validate_and_train_refuse_it_with_the_same_line(case, tmp_path, monkeypatch, capsys) -> None:
    from graphstep.cli import main

    rule = case.split("-")[0]
    monkeypatch.chdir(tmp_path)  # a run that got through would write runs/ here
    monkeypatch.setenv("WORLD_SIZE", "2")  # V17's world; the recipe's batch splits over 2 ranks
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # V21: not installed
    started = []
    monkeypatch.setattr("graphstep.training.loop.init_data_parallel", lambda *a, **k: started.append(1) or 1 / 0)
    args = ["--recipe", "llama3_tiny", *CLI_CASES[case]]
    assert main(["config", "validate", "--recipe", "llama3_tiny"]) == 0
    capsys.readouterr()

    assert main(["config", "validate", *args]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1 configuration violation:", out
    (line,) = out[1:]
    assert line.startswith(f"  {rule} [") and " Fix: " in line, line

    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and started == []  # refused by the validation before any setup
    assert f"graphstep train: 1 configuration violation:\n{line}\n" in err, err
