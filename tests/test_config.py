"""Every option of every config group composes, alone and together, and the strategy label is derived."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from src.config_check import check_command_line, with_project_hydra
from src.errors import ConfigError
from src.memory import memory_strategy

from .conftest import CONF, FAST, compose_config
from .helpers import run_cli

GROUPS = ["model", "tokenizer", "data", "memory", "optim", "trainer", "logger", "paths", "debug"]
# data=files has mandatory paths (???); give them so the whole config resolves
FILES_KEYS = ["data.src_lang=de", "data.tgt_lang=en", "data.train_prefix=a", "data.valid_prefix=b", "data.test_prefix=c"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_groups_have_the_options_the_project_promises():
    assert set(options("model")) >= {"tiny", "small", "base", "big"}
    assert set(options("tokenizer")) >= {"spacy", "xlmr"}
    assert set(options("data")) >= {"synthetic", "multi30k", "files"}
    assert set(options("memory")) >= {"none", "accum", "amp", "truncate", "tokens", "checkpoint", "chunked_ce", "trim_vocab", "auto", "fsdp"}
    assert set(options("logger")) >= {"none", "wandb"}


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_resolves(group, option, tmp_path):
    extra = FILES_KEYS if (group, option) == ("data", "files") else []
    cfg = compose_config(f"{group}={option}", *extra, run_dir=tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert resolved["paths"]["output_dir"] == str(tmp_path)
    for key in ("model", "tokenizer", "data", "memory", "optim", "trainer", "logger", "seed"):
        assert key in resolved
    if group in ("model", "tokenizer", "data", "optim"):
        assert resolved[group]["name"] == option


def test_base_model_is_the_papers():
    m = compose_config("model=base", run_dir=Path("/tmp/x")).model
    assert (m.encoder_layers, m.decoder_layers, m.d_model, m.n_heads, m.d_ff, m.dropout) == (6, 6, 512, 8, 2048, 0.1)
    s = compose_config("model=small", run_dir=Path("/tmp/x")).model
    assert (s.encoder_layers, s.decoder_layers, s.d_model) == (4, 4, 256)


def test_optim_is_adam_with_the_papers_settings():
    o = compose_config(run_dir=Path("/tmp/x")).optim
    assert list(o.betas) == [0.9, 0.98] and o.eps == 1e-9 and o.label_smoothing == 0.1 and o.clip_grad_norm
    assert compose_config("optim=noam", run_dir=Path("/tmp/x")).optim.warmup_steps == 4000


@pytest.mark.parametrize(
    "override,label",
    [
        ("memory=none", "none"),
        ("memory=amp", "amp"),
        ("memory=accum", "accum"),
        ("memory=truncate", "truncate"),
        ("memory=[amp,accum]", "amp+accum"),
        ("memory=[accum,amp]", "amp+accum"),
        ("memory=[amp,accum,truncate]", "amp+accum+truncate"),
        ("memory=tokens", "tokens"),
        ("memory=checkpoint", "checkpoint"),
        ("memory=chunked_ce", "chunked_ce"),
        ("memory=trim_vocab", "trim_vocab"),
        ("memory=[chunked_ce,tokens,checkpoint,amp]", "amp+tokens+checkpoint+chunked_ce"),
    ],
)
def test_strategies_compose_and_label_is_derived(override, label):
    cfg = compose_config(override, run_dir=Path("/tmp/x"))
    assert memory_strategy(OmegaConf.to_container(cfg.memory), cfg.data.max_tokens).label == label


def test_label_follows_values_not_file_names():
    cfg = compose_config("memory=accum", "memory.accum_steps=1", run_dir=Path("/tmp/x"))
    assert memory_strategy(OmegaConf.to_container(cfg.memory)).label == "none"
    cfg = compose_config("memory.amp=fp16", run_dir=Path("/tmp/x"))
    assert memory_strategy(OmegaConf.to_container(cfg.memory)).label == "amp"
    # FSDP gathering in bf16 (FSDP2's MixedPrecisionPolicy) is a strategy of its own
    cfg = compose_config("memory=[fsdp,amp]", "memory.fsdp_param_dtype=bf16", run_dir=Path("/tmp/x"))
    strategy = memory_strategy(OmegaConf.to_container(cfg.memory))
    assert strategy.label == "amp+fsdp(bf16)" and strategy.param_dtype == torch.bfloat16
    cfg = compose_config("memory=[fsdp,amp]", run_dir=Path("/tmp/x"))
    assert memory_strategy(OmegaConf.to_container(cfg.memory)).param_dtype is None


@pytest.mark.parametrize(
    "memory,message",
    [
        ({"amp": "fp8"}, "memory.amp=fp8"),
        ({"accum_steps": 0}, "memory.accum_steps=0"),
        ({"max_src_len": 0}, "memory.max_src_len=0"),
        ({"accum": 4}, r"^memory.accum: no such setting; did you mean memory.accum_steps\?$"),
        # an option file of one's own that sets data.max_tokens without '# @package _global_'
        ({"amp": "bf16", "data": {"max_tokens": 1024}}, r"^memory.data: no such setting; data is a group of its own: "
                                                        r"an option of memory that sets data keys needs '# @package _global_'"),
        ({"overlong": "wrap"}, "memory.overlong=wrap"),
        ({"loss_chunk": 0}, "memory.loss_chunk=0"),
        ({"checkpoint": "yes"}, "memory.checkpoint=yes"),
    ],
)
def test_bad_memory_settings_name_the_key(memory, message):
    with pytest.raises(ConfigError, match=message):
        memory_strategy(memory)


def test_a_preset_of_ones_own_without_the_global_package_line_is_refused(tmp_path):
    """Without '# @package _global_' a preset's keys land under experiment., which nothing reads: the run trained
    its 2,000 default steps on the defaults, without a word."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("trainer:\n  max_steps: 3\n")
    proc = run_cli("train.py", f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine",
                   f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 1
    assert ("error: experiment=mine: its settings landed under experiment (experiment.trainer), which nothing reads: "
            "options of experiment set other groups' keys, so their files start with the line '# @package _global_' "
            "(as conf/experiment/'s do)") in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("text, message", [
    (b"# @package _global_\ntrainer:\n  max_steps: 3\n   eval_every: 2\n",
     "{file}:4:14: mapping values are not allowed here"),
    (b"# @package _global_\nseed: 5\nseed: 6\n", "{file}:3:1: found duplicate key seed"),
    (b"# @package _global_\nseed: 5 # caf\xe9\n",
     "{file}: not UTF-8 text (invalid continuation byte at byte 33); save it as UTF-8"),
])
def test_a_config_file_of_ones_own_that_does_not_read_is_named_in_one_line(tmp_path, text, message):
    """YAML that does not parse was a page of yaml's traceback; a file in Latin-1, a line without the file."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_bytes(text)
    with pytest.raises(ConfigError) as e:
        check_command_line([f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine"])
    assert str(e.value) == message.format(file=tmp_path / "experiment" / "mine.yaml")


def test_missing_mandatory_key_is_named(tmp_path):
    from src.errors import ConfigError
    from src.run import train

    with pytest.raises(ConfigError, match=r"data.src_lang is required: add data.src_lang=\.\.\."):
        train(compose_config("data=files", run_dir=tmp_path))


def test_a_model_file_of_ones_own_with_a_typo_is_named_before_the_data(tmp_path, monkeypatch):
    """conf/model/medium.yaml with ``encoder_layer: 5``: the key, the file that sets it (whatever its ``name:`` says)
    and the closest key, before the corpus is read (it failed in ModelArgs' constructor after tokenizing, naming
    neither); a memory file's typo likewise."""
    from src import config_check
    from src.memory import memory_strategy
    from src.run import train
    from src.settings import check_model

    cfg = compose_config(*FAST, run_dir=tmp_path / "run", cache_dir=tmp_path / "cache")
    with open_dict(cfg):
        cfg.model.encoder_layer = 5  # as an option file would set it (the command line's + is refused before)
    with pytest.raises(ConfigError, match=r"^model.encoder_layer: no such setting; did you mean model.encoder_layers"):
        train(cfg)
    assert not (tmp_path / "cache").exists()  # before the corpus was read
    conf = tmp_path / "conf"  # a conf/ of one's own, with the files
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "medium.yaml").write_text("name: small\nd_model: 384\nn_heads: 6\nencoder_layer: 5\n")
    (conf / "memory").mkdir()
    (conf / "memory" / "lowmem.yaml").write_text("# @package _global_\nmemory:\n  amp: bf16\n  chekpoint: true\n")
    monkeypatch.setattr(config_check, "CONF", conf)
    with pytest.raises(ConfigError, match=r"^model.encoder_layer \(set in conf/model/medium.yaml\): no such setting; "
                                          r"did you mean model.encoder_layers\?$"):
        check_model({"name": "small", "d_model": 384, "n_heads": 6, "encoder_layer": 5})
    with pytest.raises(ConfigError, match=r"^memory.chekpoint \(set in conf/memory/lowmem.yaml\): no such setting; "
                                          r"did you mean memory.checkpoint\?$"):
        memory_strategy({"amp": "bf16", "chekpoint": True})


@pytest.mark.slow
def test_options_of_ones_own_in_hydra_searchpath_are_checked_as_conf_s_are(tmp_path):
    """hydra.searchpath=[file:///my/conf]: its options compose in the command line's check (model=medium was a
    MissingConfigException traceback, the check composing conf/ alone), and a typo in its file names that file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "medium.yaml").write_text("defaults:\n  - small\n  - _self_\nname: medium\nencoder_layers: 5\n")
    (tmp_path / "model" / "typo.yaml").write_text("defaults:\n  - small\n  - _self_\nname: typo\nencoder_layer: 5\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path}]"
    check_command_line([searchpath, "model=medium", "model.decoder_layers=3", "model.d_ff=512"])
    check_command_line(["-m", searchpath, "model=medium,small"])
    with pytest.raises(ConfigError, match=r"^model=mediun: no such option; model is one of base, big, medium, small, "
                                          r"tiny, typo$"):
        check_command_line([searchpath, "model=mediun"])
    with pytest.raises(ConfigError, match=r"^model.decoder_layer: no such key; did you mean model.decoder_layers\?$"):
        check_command_line([searchpath, "model=medium", "model.decoder_layer=3"])
    # --config-dir (-cd) is such a folder too: Hydra's flags left every override unchecked
    for flag in (["--config-dir", str(tmp_path)], [f"--config-dir={tmp_path}"], ["-cd", str(tmp_path)]):
        check_command_line([*flag, "model=medium"])
        with pytest.raises(ConfigError, match=r"^trainer.max_step: no such key; did you mean trainer.max_steps\?$"):
            check_command_line([*flag, "model=medium", "trainer.max_step=4"])
    # Hydra's glob lists conf/'s options only: it launched no job, and the sweep said a job "did not complete"
    with pytest.raises(ConfigError, match=r"^model=glob\(med\*\): matches no option \(model is one of base, big, "
                                          r"small, tiny\), so the sweep has no job; Hydra's glob lists the options in "
                                          r"conf/, not those in hydra.searchpath's folders: name them$"):
        check_command_line(["-m", searchpath, "model=glob(med*)"])
    with pytest.raises(ConfigError, match=r"^seed=range\(0\): gives no value, so the sweep has no job$"):
        check_command_line(["-m", "seed=range(0)"])
    # a preset of one's own whose sweep (hydra.sweeper.params) names an option that does not exist: Hydra's
    # multi-line error in train.py, a MissingConfigException traceback in plan.py -m
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nhydra:\n  sweeper:\n    params:\n"
                                                       "      memory: none,amd\n")
    preset = r"^memory=amd: no such option; memory is one of accum, .* \(in experiment=mine's hydra.sweeper.params\)$"
    with pytest.raises(ConfigError, match=preset):
        check_command_line(["-m", searchpath, "experiment=mine"])
    import plan

    assert plan.main(["-m", searchpath, "experiment=mine"]) == 1
    sizes = ["plan.src_len=20", "plan.tgt_len=20", "plan.src_vocab=100", "plan.tgt_vocab=100"]
    for flag in (["--config-dir", str(tmp_path)], ["-cd", str(tmp_path)]):  # plan.py takes train.py's flag too
        assert plan.main([*flag, "model=medium", *sizes]) == 0
    fast = [o for o in FAST if not o.startswith("model=")]
    proc = run_cli("train.py", searchpath, *fast, "model=typo", f"hydra.run.dir={tmp_path / 'run'}",
                   f"paths.cache_dir={tmp_path / 'cache'}")
    assert proc.returncode == 1
    assert (f"error: model.encoder_layer (set in {tmp_path / 'model' / 'typo.yaml'}): no such setting; did you mean "
            "model.encoder_layers?") in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()  # before the corpus was read


def test_overrides_of_a_primary_config_given_by_config_path_and_name_are_checked(tmp_path):
    """--config-path <run>/.hydra --config-name config (a run's saved config, run again) and -cn: every override was
    left unchecked (Hydra's flags), and model=base set the saved config's model to the string 'base'."""
    saved = tmp_path / ".hydra"
    saved.mkdir()
    OmegaConf.save(compose_config("trainer.max_steps=7", run_dir=tmp_path), saved / "config.yaml")
    primary = ["--config-path", str(saved), "--config-name", "config"]
    check_command_line([*primary, "trainer.max_steps=5", "memory.accum_steps=2"])
    for override, message in [("trainer.max_step=5", r"trainer.max_step: no such key; did you mean trainer.max_steps\?"),
                              ("trainer.max_steps=abc", r"trainer.max_steps=abc: expected an integer \(the default is 7\)"),
                              ("model=base", rf"model=base: {saved}/config.yaml is composed already, and its folder "
                                             r"has no model options; set model's keys instead \(model.key=value\)")]:
        with pytest.raises(ConfigError, match=f"^{message}$"):
            check_command_line([*primary, override])
    with pytest.raises(ConfigError, match=f"^--config-path {saved} --config-name confi: no file {saved}/confi.yaml$"):
        check_command_line([f"-cp={saved}", "-cn", "confi"])
    with pytest.raises(ConfigError, match=r"^model=bse: no such option; model is one of base, big, small, tiny$"):
        check_command_line(["-cn", "train", "model=bse"])  # conf/'s own, named
    check_command_line(["model=base"])  # and the next check composes conf/train.yaml again


def test_a_saved_config_run_again_is_given_conf_hydra_settings(tmp_path):
    """A run's .hydra/config.yaml has no defaults list: Hydra's own settings would put the run in
    outputs/<date>/<time> and a sweep without its report (tests/test_sweeps.py runs it). conf/ is searched too and
    its hydra/default.yaml chosen, beside the other overrides, which Hydra's parser takes as one run of words."""
    saved = tmp_path / ".hydra"
    saved.mkdir()
    OmegaConf.save(compose_config(run_dir=tmp_path), saved / "config.yaml")
    primary = ["--config-path", str(saved), "--config-name", "config"]
    assert with_project_hydra([*primary, "seed=1", "-m"]) == [f"--config-dir={CONF}", *primary, "+hydra=default",
                                                              "seed=1", "-m"]
    assert with_project_hydra([f"-cp={saved}", "-cn=config"]) == [f"--config-dir={CONF}", f"-cp={saved}",
                                                                  "-cn=config", "+hydra=default"]
    assert with_project_hydra([*primary, "--cfg", "hydra"])[-1] == "+hydra=default"  # (--cfg's word, no option)
    # torchrun's other ranks log as conf/hydra/job_logging/other_ranks.yaml says, which Hydra could not find
    proc = run_cli("train.py", *primary, "--cfg", "hydra", env_extra={"RANK": "1"})
    assert proc.returncode == 0 and "[rank ${oc.env:RANK,?}]" in proc.stdout, proc.stderr[-2000:]
    (saved / "own.yaml").write_text("defaults:\n  - _self_\nseed: 1\n")
    for argv in (["seed=1"],  # conf/train.yaml
                 [*primary, "-cd", str(tmp_path)],  # a folder of one's own (Hydra takes one --config-dir)
                 ["-cp", str(saved), "-cn", "own"]):  # a primary config with a defaults list chooses its own
        assert with_project_hydra(argv) == argv


def test_a_model_setting_that_a_model_file_of_ones_own_leaves_out_can_be_added():
    """conf/model/partial.yaml without d_ff trains with ModelArgs' 2048: +model.d_ff=1536 is read (it was refused as
    read by nothing), and model.d_ff=1536 without + says to add it."""
    from src.config_check import _unknown_key, _unread_key

    partial = {"model": {"name": "partial", "d_model": 384, "n_heads": 6}}
    assert _unread_key("+model.d_ff=1536", partial, ["model=partial"]) is None
    assert _unread_key("+model.d_fff=1536", partial, []) == ("+model.d_fff=1536: nothing reads model.d_fff; "
                                                           "did you mean model.d_ff?")
    assert _unread_key("+model.src_vocab=9", partial, []).startswith("+model.src_vocab=9: nothing reads")
    assert _unknown_key("model.d_ff", ["model=partial"]) == (
        "model.d_ff: the model option chosen does not set it (ModelArgs' default applies); set it with +model.d_ff=...")


def documented_commands() -> list[tuple[str, list[str]]]:
    """The ``train.py`` and ``plan.py`` command lines in the bash blocks of the README and of experiments/."""
    import re
    import shlex

    root = CONF.parent
    found = []
    for doc in [root / "README.md", *sorted((root / "experiments").rglob("README.md"))]:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.search(r"(?:python3?|torchrun[^#]*?)\s+(?:\S*/)?(?:train|plan)\.py(\s.*|$)", line)
                if command and "$" not in line:  # shell variables: not a command to compose as written
                    found.append((f"{doc.relative_to(root)}: {line.strip()}", shlex.split(command[1].split(" #")[0])))
    return found


@pytest.mark.slow
def test_every_documented_command_composes():
    """What the docs tell users to type composes: every key, option and value of each job (each job of a sweep).
    A renamed key or option fails here, not in a reader's terminal."""
    from src.config_check import check_command_line

    commands = documented_commands()
    assert len(commands) >= 15 and any("-m" in args for _, args in commands)
    for where, args in commands:
        try:
            check_command_line(args)
        except ConfigError as e:
            pytest.fail(f"{where}\n  {e}")


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_an_optim_group_given_beside_a_preset_trains_with_its_schedule(preset):
    """A preset chooses an optim group; another given on the command line takes that group's learning rate and
    warmup (multi30k_small set optim.lr and warmup_steps itself, so optim=noam trained at Adam's 5e-4 after 400
    steps under noam's name)."""
    for group in ("adam", "noam"):
        own = OmegaConf.load(CONF / "optim" / f"{group}.yaml")
        optim = compose_config(f"experiment={preset}", f"optim={group}").optim
        assert (optim.name, optim.lr, optim.warmup_steps) == (group, own.lr, own.warmup_steps)


def test_a_presets_value_is_not_the_type_its_key_takes():
    """paper_base sets trainer.max_len_a to 1, an integer; the key takes a number, as its group default (1.5) says."""
    check_command_line(["experiment=paper_base", "trainer.max_len_a=1.2"])
    with pytest.raises(ConfigError, match=r"^trainer.max_len_a=abc: expected a number \(the default is 1.5\)$"):
        check_command_line(["experiment=paper_base", "trainer.max_len_a=abc"])


def test_list_settings_and_interpolated_defaults_are_typed_by_what_they_take():
    """tags takes a list (tags=memory would tag m, e, m, o, r, y); logger.wandb.tags defaults to ${tags}, which
    is no string to type a list against; a number for a string key is told how to quote it."""
    check_command_line(["logger=wandb", "logger.wandb.tags=[a,b]", "tags=[memory]", "data=multi30k", "data.root=/x"])
    with pytest.raises(ConfigError, match=r"^tags=memory: expected a list, e.g. tags=\[memory\]$"):
        check_command_line(["tags=memory"])
    with pytest.raises(ConfigError, match=r"^tokenizer.name_or_path=2016: expected a string .*; quote it: "
                                          r"'tokenizer.name_or_path=\"2016\"'$"):
        check_command_line(["tokenizer=xlmr", "tokenizer.name_or_path=2016"])


def test_a_glob_sweep_over_a_groups_options_is_checked_job_by_job():
    """memory=glob([amp,acc*]) sweeps the options it matches (Hydra lists them from conf/); the check did not
    know the options and stopped with Hydra's "ConfigLoader is not set"."""
    from src.config_check import sweep_jobs

    assert sweep_jobs(["memory=glob([amp,acc*])", "model=tiny"], True) == [["memory=accum", "model=tiny"],
                                                                       ["memory=amp", "model=tiny"]]
    check_command_line(["-m", "memory=glob([amp,acc*])"])
    with pytest.raises(ConfigError, match=r"^trainer.max_steps=abc: expected an integer \(the default is \d+\)$"):
        check_command_line(["-m", "memory=glob(*,exclude=[fsdp,auto])", "trainer.max_steps=abc"])


def test_a_key_added_with_plus_is_refused_only_where_no_job_reads_it():
    """A sweep whose jobs choose other options may add a key that some of them read (Hydra lets no job add it
    otherwise); a key no job reads is refused once, for the sweep."""
    check_command_line(["-m", "tokenizer=spacy,xlmr", "++tokenizer.min_freq=1"])
    check_command_line(["-m", "data=synthetic,multi30k", "++data.long_fraction=0.1"])
    for argv in (["++data.long_fraction=0.1", "data=multi30k"], ["-m", "memory=none,amp", "+trainer.foo=1"]):
        with pytest.raises(ConfigError) as e:
            check_command_line(argv)
        assert str(e.value).count("nothing reads") == 1 and "\n" not in str(e.value), argv
    check_command_line(["+model@teacher=base"])  # a group in another package: Hydra's to read


def test_keys_of_ones_own_go_under_meta_and_stay_with_the_run(tmp_path):
    """+run_name=foo was refused as read by nothing, with nowhere else to put it: under meta it is kept in the
    run's config (and its overrides) and can name the run's directory."""
    check_command_line(["+meta.run_name=foo", "+meta.lab.node=3", "hydra.run.dir=outputs/${meta.run_name}"])
    cfg = compose_config("+meta.run_name=foo", run_dir=tmp_path)
    assert cfg.meta.run_name == "foo"
    # deleting what nothing requires: a key of one's own, a model setting (ModelArgs' default then applies)
    check_command_line(["~meta"])
    check_command_line(["~model.d_ff"])


def test_an_interpolation_that_does_not_resolve_is_one_line(monkeypatch):
    """Listing every missing key resolves interpolations on the way: one that does not resolve stays one line."""
    from src.settings import resolve_config

    monkeypatch.delenv("NOPE_UNSET", raising=False)
    with pytest.raises(ConfigError, match=r"^data.seed: .*Environment variable 'NOPE_UNSET' not found"):
        resolve_config(compose_config("data.seed=${oc.env:NOPE_UNSET}"))


def test_a_sweeping_preset_run_without_m_or_among_presets_says_what_runs():
    """experiment=memory_sweep without -m ran one job of its eight (Hydra ignores hydra.sweeper.params without
    -m) and said nothing; presets that do not sweep, -m, and commands without a preset get no note."""
    from src.config_check import preset_sweep_note

    note = preset_sweep_note(["experiment=memory_sweep", "trainer.max_steps=2"])
    assert note == ("note: experiment=memory_sweep is a sweep (memory=none,amp,accum,truncate,checkpoint,chunked_ce,"
                    "[amp,accum],[amp,checkpoint]); without -m this runs one job, with the command line's settings: "
                    "add -m to run them all")
    for argv in (["-m", "experiment=memory_sweep"], ["experiment=throughput_ref"], ["debug=overfit"],
                 ["memory=amp"], ["experiment=memory_sweep", "--cfg", "job"],
                 ["-m", "experiment=multi30k_small,throughput_ref"]):
        assert preset_sweep_note(argv) is None, argv
    # presets swept with -m: Hydra runs one job of each, none of their own sweeps, and said nothing
    assert preset_sweep_note(["-m", "experiment=multi30k_small,memory_sweep"]) == (
        "note: experiment=multi30k_small,memory_sweep runs a job of each preset, without their own sweeps: "
        "experiment=memory_sweep (memory=none,amp,accum,truncate,checkpoint,chunked_ce,[amp,accum],[amp,checkpoint]); "
        "run a preset that sweeps on its own to run its sweep")


def test_accum_steps_up_to_the_batchs_pairs_and_seeds_up_to_2_to_the_63_minus_1_are_taken():
    """The edges of two settings checked before the data is read: micro-batches of one pair (accum_steps equal to
    data.batch_size) are allowed, one more is not; the seed takes -2**63 to 2**63 - 1, as its message says."""
    from src.settings import check_settings

    def check(*overrides: str) -> None:
        check_settings(OmegaConf.to_container(compose_config(*overrides, run_dir=Path("/nonexistent")), resolve=True))

    check("memory=accum", "memory.accum_steps=64", "data.batch_size=64")
    with pytest.raises(ConfigError, match=r"^memory.accum_steps=65: more micro-batches than the 64 pairs"):
        check("memory=accum", "memory.accum_steps=65", "data.batch_size=64")
    check(f"seed={2**63 - 1}")
    check(f"seed={-2**63}")
    with pytest.raises(ConfigError, match=rf"^seed={2**63}: must be an integer from -2\*\*63 to 2\*\*63 - 1"):
        check(f"seed={2**63}")
