"""Command-line overrides checked before anything runs: every problem, each as one line that names the key and the
fix; and the keys of model and memory option files (``check_known_keys``), checked before the data is read.

Hydra reports a mistyped key or option over several lines and suggests appending it (``+model.dmodel=5``); a value
of the wrong type (``trainer.max_steps=abc``) it accepts, and the run fails later. Here the overrides are composed
first: a key that does not exist gets the closest existing one, an option that does not exist gets the list, and
every value is checked against the type of the value it replaces (the defaults are the schema: an integer stays an
integer, a number a number, a flag true or false; null defaults accept anything). A key added with ``+`` that no
option of its group has is refused too (nothing reads it), but for the keys of ``OPEN_KEYS``.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import os
import re
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
HYDRA_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc",
               "--resolve", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
               "-cd", "--experimental-rerun", "--version")


def check_command_line(argv: list[str]) -> None:
    """Raise ``ConfigError`` with a line for each problem in ``train.py``'s overrides (in every job's, with ``-m``;
    a problem that several jobs share, once)."""
    argv, primary = primary_config(_config_dir_as_searchpath(argv))
    if _hydra_command(argv):  # Hydra's own commands: left to Hydra, but for what it refuses in a traceback
        if problem := _hydra_command_problem(argv):
            raise ConfigError(problem)
        return
    if primary == _PRIMARY:
        _check_jobs(argv)
        return
    default, _PRIMARY[:] = list(_PRIMARY), primary  # every compose below reads it
    _defaults.cache_clear()
    try:
        _check_jobs(argv)
    finally:
        _PRIMARY[:] = default
        _defaults.cache_clear()


def _check_jobs(argv: list[str]) -> None:
    multirun = _multirun(argv)
    overrides = [a for a in argv if not a.startswith("-")]
    problems = [*_output_dir_problems(overrides, multirun), *_jobs_problems(sweep_jobs(overrides, multirun))]
    if multirun and not problems:  # and the jobs of a preset's own sweep (a file of one's own may mistype it)
        jobs, params = sweep_with_preset(overrides)
        if params:
            preset = next((o for o in overrides if o.split("=")[0] in PRESETS), "the config")
            problems = [f"{p} (in {preset}'s hydra.sweeper.params)" for p in _jobs_problems(jobs)]
    if problems:
        raise ConfigError("\n".join(problems))


# the primary config Hydra composes, as a folder and a name: conf/train.yaml, or --config-path's and --config-name's
_PRIMARY = [CONF, "train"]


def primary_config(argv: list[str]) -> tuple[list[str], list]:
    """``argv`` without ``--config-path``/``-cp`` and ``--config-name``/``-cn``, and the primary config they name:
    a run's saved ``.hydra/config.yaml`` run again (README: Experiment presets), or a primary config of one's own.
    A relative path is taken from train.py's folder, as Hydra takes it."""
    folder, name, rest, args = _PRIMARY[0], _PRIMARY[1], [], iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag not in ("--config-path", "-cp", "--config-name", "-cn"):
            rest.append(arg)
            continue
        value = value if eq else next(args, "")
        if flag in ("--config-path", "-cp"):
            folder = CONF.parent / Path(value).expanduser()  # an absolute path stays as it is
        else:
            name = value.removesuffix(".yaml")
    if [folder, name] != _PRIMARY and not (folder / f"{name}.yaml").is_file():
        raise ConfigError(f"--config-path {folder} --config-name {name}: no file {folder / name}.yaml"
                          if folder.is_dir() else f"--config-path {folder}: no such folder")
    return rest, [folder.resolve(), name]


def _jobs_problems(jobs: list[list[str]]) -> list[str]:
    """The problems of a sweep's jobs (of one run's), each once."""
    problems: list[str] = []
    for job in jobs:
        try:
            check_overrides(job, unread=len(jobs) == 1)
        except ConfigError as e:
            problems += [p for p in str(e).splitlines() if p not in problems]
    if len(jobs) > 1:
        problems += _unread_by_every_job(jobs)
    return problems


def sweep_with_preset(overrides: list[str]) -> tuple[list[list[str]], list[str]]:
    """The jobs train.py -m runs, and the sweep a preset sets (hydra.sweeper.params, experiment=memory_sweep's):
    the preset's sweep first, then the command line's, as Hydra's basic sweeper takes them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeps = {o.input_line for o in OverridesParser.create().parse_overrides(overrides) if o.is_sweep_override()}
    params = preset_sweep([o for o in overrides if o not in sweeps])  # composable as they are: no lists or ranges
    return sweep_jobs([*params, *overrides], True), params


def preset_sweep(overrides: list[str]) -> list[str]:
    """The sweep a preset sets (``hydra.sweeper.params``: experiment=memory_sweep's strategies) as overrides, which
    Hydra's basic sweeper runs before the command line's. ``overrides`` compose as they are (no lists or ranges)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(_PRIMARY[0]), version_base="1.3"):
        cfg = compose(config_name=_PRIMARY[1], overrides=overrides, return_hydra_config=True)
    return [f"{key}={value}" for key, value in (cfg.hydra.sweeper.get("params") or {}).items()]


def preset_sweep_note(argv: list[str]) -> str | None:
    """A preset that sweeps, run without -m: Hydra runs one job of it and says nothing. With -m, presets swept
    (``-m experiment=a,memory_sweep``): Hydra runs none of their own sweeps, and says nothing either."""
    preset = next((a for a in argv if a.split("=")[0] in PRESETS), None)
    if preset is None or _hydra_command(argv):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    if not _multirun(argv):
        params = preset_sweep(overrides)
        return (f"note: {preset} is a sweep ({' '.join(params)}); without -m this runs one job, with the command "
                "line's settings: add -m to run them all") if params else None
    chosen = sweep_jobs([preset], True)
    if len(chosen) == 1:
        return None  # one preset: its sweep runs
    sweeping = [f"{job[0]} ({' '.join(params)})" for job in chosen if (params := preset_sweep(job))]
    return (f"note: {preset} runs a job of each preset, without their own sweeps: {', '.join(sweeping)}; run a "
            "preset that sweeps on its own to run its sweep") if sweeping else None


def _output_dir_problems(overrides: list[str], multirun: bool) -> list[str]:
    """The run directory (the sweep's, with -m) naming a file, or under one: Hydra's FileExistsError traceback.
    Hydra takes the path as written (a ~ is a folder named ~)."""
    problems = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") != ("hydra.sweep.dir" if multirun else "hydra.run.dir") or not value or "${" in value:
            continue
        path = Path(value.strip("'\""))
        blocker = next((p for p in (path, *path.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            where = "is a file" if blocker == path else f"lies under {blocker}, a file"
            problems.append(f"{override}: {where}; name a directory")
        elif blocker is not None and (why := _cannot_write_in(blocker)):  # Hydra's traceback, from its mkdir
            where = "" if blocker == path else f"lies under {blocker}, where "
            problems.append(f"{override}: {where}this process cannot write ({why}); name a directory it can")
    return problems


def _cannot_write_in(folder: Path) -> str | None:
    """Why a folder cannot be written in, found by making a folder there and removing it (permissions and
    read-only mounts alike: os.access passes a sysfs folder where mkdir fails); None where it can."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=folder))
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _config_dir_as_searchpath(argv: list[str]) -> list[str]:
    """``--config-dir DIR`` (``-cd DIR``) as the ``hydra.searchpath=[file://DIR]`` it amounts to here: a folder of
    one's own whose options are chosen and checked as conf/'s are. Left as it is beside a searchpath of the command
    line's (Hydra searches both)."""
    if _searchpath(argv):
        return argv
    out, rest = [], iter(argv)
    for arg in rest:
        flag, eq, value = arg.partition("=")
        if flag in ("--config-dir", "-cd"):
            folder = value if eq else next(rest, "")
            out.append(f"hydra.searchpath=['file://{Path(folder).expanduser().resolve()}']")
        else:
            out.append(arg)
    return out


PROJECT_HYDRA = "+hydra=default"  # conf/hydra/default.yaml, chosen by with_project_hydra (not recorded as an override)


def without_project_hydra(overrides) -> list[str]:
    """A job's overrides less the one ``with_project_hydra`` adds to a saved config run again: as typed."""
    return [o for o in overrides if o != PROJECT_HYDRA]


def with_project_hydra(argv: list[str]) -> list[str]:
    """``argv`` for Hydra. Where it names a primary config without a defaults list (a run's saved
    ``.hydra/config.yaml``, run again), Hydra's own settings would apply: the run in ``outputs/<date>/<time>``, a
    sweep in ``multirun/`` without its report or exit status. So conf/ is searched too and its
    ``hydra/default.yaml`` chosen, as every run of conf/train.yaml has it. Left as it is beside a
    ``--config-dir`` of the command line's (Hydra takes one) or a ``hydra`` option of its own."""
    _, (folder, name) = primary_config(argv)
    if ([folder, name] == _PRIMARY or any(a.split("=")[0] in ("--config-dir", "-cd") for a in argv)
            or any(a.lstrip("+").startswith("hydra=") for a in argv)
            or "defaults" in OmegaConf.load(folder / f"{name}.yaml")):
        return argv
    # beside the other overrides: Hydra's parser takes them as one run of words (none after a flag that follows them)
    at = next((i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), len(argv))
    return [f"--config-dir={CONF}", *argv[:at], PROJECT_HYDRA, *argv[at:]]


def _hydra_command(argv: list[str]) -> bool:
    return any(a.split("=")[0] in HYDRA_FLAGS for a in argv)


def _hydra_command_problem(argv: list[str]) -> str | None:
    """What Hydra's own commands refuse over several lines or in a traceback: ``-m --cfg job`` (a ValueError),
    ``--cfg job memory=amp,accum`` ("Ambiguous value"), ``--experimental-rerun`` (its job cannot resolve
    ``${hydra:...}``, and would write into the old run's directory)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    flags = [a.split("=")[0] for a in argv if a.startswith("-")]
    if "--experimental-rerun" in flags:
        return ("--experimental-rerun: Hydra's rerun goes back into the old run's directory, whose checkpoints a run "
                "does not overwrite; run it again from the config it saved: python train.py --config-path "
                "<run>/.hydra --config-name config hydra.run.dir=<new directory> (README: Experiment presets)")
    printing = next((f for f in flags if f in ("--cfg", "-c", "--info", "-i")), None)
    if printing is None:
        return None
    multirun = next((f for f in flags if f in ("-m", "--multirun")), None)
    if multirun:
        return (f"{multirun} with {printing}: Hydra takes one or the other; leave {multirun} out and give one job's "
                f"values ({printing} shows that job's config and runs nothing)")
    values = [a for a in argv if not a.startswith("-") and "=" in a]  # not the values of --cfg job, -cn name
    try:
        parsed = OverridesParser.create().parse_overrides(values)
    except HydraException:
        return None  # Hydra's parse error says which
    sweep = next((o.input_line for o in parsed if o.is_sweep_override()), None)
    return f"{sweep}: {printing} describes one job; give one of the values" if sweep else None


def _multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun", "hydra.mode=MULTIRUN") for a in argv)


def check_launcher(argv: list[str]) -> None:
    """A sweep sent to SLURM from a machine without it: one line instead of submitit's traceback. A job's GPUs
    that its tasks would not use, refused before it is submitted: each task of a job is one rank of its run
    (``distributed.world_from_env``), on one GPU of its own (or on the CPU, with none)."""
    if _hydra_command(argv):
        return  # --cfg and the like print and launch nothing
    launcher = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra/launcher=")), None)
    if launcher in ("slurm", "submitit_slurm", "local", "submitit_local"):
        _check_job_resources(launcher, [a for a in argv if a.startswith("hydra.launcher.") and "," not in a])
    if _multirun(argv) and launcher in ("slurm", "submitit_slurm") and shutil.which("srun") is None:
        raise ConfigError(f"hydra/launcher={launcher} submits the sweep's jobs to SLURM, whose srun is not on this "
                          "machine: run the command on the cluster, or leave the launcher out to run the jobs here")


def _check_job_resources(launcher: str, overrides: list[str]) -> None:
    """A job's tasks, GPUs and cores, as the launcher preset and the command line's ``hydra.launcher.*`` set them:
    a GPU per task, or none (trainer.device=cpu); no more cores than this machine lets the sweep use."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from .environment import usable_cores

    try:
        with initialize_config_dir(config_dir=str(_PRIMARY[0]), version_base="1.3"):
            job = compose(config_name=_PRIMARY[1], overrides=[f"hydra/launcher={launcher}", *overrides],
                          return_hydra_config=True).hydra.launcher
    except HydraException:
        return  # a key the launcher does not have: Hydra's own error says so when it launches
    given = {a.split("=", 1)[0].removeprefix("hydra.launcher."): a for a in overrides}

    def named(key: str) -> str:
        return given.get(key, f"hydra.launcher.{key}={job.get(key)} (hydra/launcher={launcher}'s)")

    tasks, per_task = job.get("tasks_per_node") or 1, job.get("gpus_per_task")
    if per_task is not None and per_task > 1:
        raise ConfigError(f"{named('gpus_per_task')}: each task of a job is one rank of its run, on one GPU; for "
                          f"more GPUs raise hydra.launcher.tasks_per_node (README: More than one GPU)")
    gpus = job.get("gpus_per_node")
    if gpus and gpus != tasks:
        fix = (f"raise hydra.launcher.tasks_per_node to {gpus}, one task per GPU" if gpus > tasks else
               f"set hydra.launcher.gpus_per_node={tasks} (or 0 to train on the CPU)")
        raise ConfigError(f"{named('gpus_per_node')} with {named('tasks_per_node')}: each task of a job is one "
                          f"rank of its run, on a GPU of its own; {fix} (README: More than one GPU)")
    cpus = (job.get("cpus_per_task") or 0) * tasks  # hydra/launcher=local gives each job cores of its own
    if launcher == "local" and cpus > (cores := len(usable_cores())):
        raise ConfigError(f"{named('cpus_per_task')} with {named('tasks_per_node')}: a job would take {cpus} cores "
                          f"and this machine lets the sweep use {cores}; lower it (null: the jobs share the cores, "
                          "one at a time on a machine without GPUs)")


def sweep_jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper splits them (``glob(...)`` of a group's options included)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import create_config_search_path
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    # the config loader lets glob(...) sweeps list the options they match (memory=glob([amp,acc*]))
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF)))
    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
    except HydraException as e:
        home = next((o for o in overrides if "=~" in o), None)  # the shell leaves the ~ of key=~/path as typed
        if home is not None:
            key, value = home.split("=", 1)
            raise ConfigError(f"{home}: a bare ~ is not allowed in an override; write {key}=$HOME{value[1:]} "
                              f"or quote it: '{key}=\"{value}\"'") from None
        first, reason = (str(e).splitlines() + [""])[:2]  # Error parsing override '...', and Hydra's reason
        reason = "" if not reason or reason.startswith("See ") else f": {reason}"
        hint = ("; quote an interpolation inside one: 'key=\"${oc.decode:${oc.env:NAME}}\"'"
                if any("${" in o for o in overrides) else " (overrides are key=value)")
        raise ConfigError(first + reason + hint) from None
    if not multirun:
        if any(o.is_sweep_override() for o in parsed):
            sweep = next(o.input_line for o in parsed if o.is_sweep_override())
            raise ConfigError(f"{sweep}: a list of values is a sweep; add -m (python train.py -m {sweep})")
        return [overrides]
    jobs = BasicSweeper.split_arguments(parsed, None)[0]
    if not jobs:  # Hydra launches no job and says nothing more
        glob = next((o for o in parsed if "glob(" in o.input_line), None)
        if glob is None:  # seed=range(0)
            empty = next(o.input_line for o in parsed if o.is_sweep_override())
            raise ConfigError(f"{empty}: gives no value, so the sweep has no job")
        group = glob.key_or_group
        options = f" ({group} is one of {', '.join(_options(group))})" if (CONF / group).is_dir() else ""
        elsewhere = ("; Hydra's glob lists the options in conf/, not those in hydra.searchpath's folders: name "
                     "them") if _searchpath(overrides) else ""
        raise ConfigError(f"{glob.input_line}: matches no option{options}, so the sweep has no job{elsewhere}")
    return jobs


def _searchpath(overrides: list[str]) -> list[str]:
    """``hydra.searchpath=[file:///my/conf]`` overrides: folders of one's own, whose options compose as conf/'s do."""
    return [o for o in overrides if o.split("=")[0].lstrip("+") == "hydra.searchpath"]


def _searchpath_folders(overrides: list[str]) -> list[Path]:
    """The folders that ``hydra.searchpath=[file:///my/conf,...]`` overrides name."""
    values = (o.split("=", 1)[1].strip("[]").replace("'", "").replace('"', "") for o in _searchpath(overrides))
    return [Path(f.strip().removeprefix("file://")) for v in values for f in v.split(",")
            if f.strip().startswith("file://")]


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(_PRIMARY[0]), version_base="1.3"):
        return compose(config_name=_PRIMARY[1], overrides=overrides)


@functools.lru_cache(maxsize=64)
def _defaults(choices: tuple[str, ...]) -> dict:
    """The config of these group options, as plain data: the types the values are checked against. A sweep's
    jobs share their groups' options, so each set is composed once. Read only."""
    return OmegaConf.to_container(_compose(list(choices)), resolve=False)


def check_overrides(overrides: list[str], unread: bool = True) -> None:
    """Raise ``ConfigError`` with a line for each problem in one job's overrides. A key or option that does not
    exist is left out of the next compose, with the keys under it (checked once it is fixed), until the rest
    composes; then every value is checked. ``unread``: a key added with + that nothing reads is a problem (a
    sweep's job leaves that to ``_unread_by_every_job``)."""
    refused = {o: problem for o in overrides if (problem := _group_problem(o))}
    problems, overrides = list(refused.values()), [o for o in overrides if o not in refused]
    cfg, overrides = _compose_leaving_out_unknown(overrides, problems)
    # The values typed against the defaults of the same groups. A preset's values are not the schema: the group's
    # own default is (paper_base's max_len_a of 1 takes 1.2, as trainer.max_len_a's 1.5 does).
    groups = _composing(overrides)
    defaults = _defaults(tuple(groups))
    group_defaults = _defaults(tuple(o for o in groups if o.split("=")[0] not in PRESETS))
    given = OmegaConf.to_container(cfg, resolve=False)
    for override in overrides:
        if _group_choice(override):
            continue
        if unread and override.startswith("+") and (not_read := _unread_key(override, defaults, groups)):
            problems.append(not_read)
            continue
        key = override.split("=")[0].lstrip("+~")
        default = _get(group_defaults, key)
        if override.startswith("~"):  # a null one is refused while composing (Hydra has it as missing)
            if default is not _MISSING and not (CONF / key).is_dir() and not _open(key) and not _model_reads(key):
                # (~memory: _deleted_group_problem's; ~model.d_ff: ModelArgs' default applies)
                problems.append(_deleted_key_problem(override, key, default))
            continue
        group, _, leaf = key.partition(".")
        if leaf == "name" and (CONF / group).is_dir() and _get(given, key) != default:
            # the loader follows data.name, but the keys are the chosen option's: data.name=multi30k alone read
            # Multi30k without data.root, which the synthetic option does not have
            problems.append(f"{override}: {key} names the option chosen; choose it with {group}={_get(given, key)}")
            continue
        try:
            _check_type(key, _get(defaults, key) if default is _MISSING else default, _get(given, key))
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))


def _deleted_key_problem(override: str, key: str, default) -> str:
    """``~trainer.log_every``: a setting the run reads, deleted (the run said ``trainer.log_every=None``)."""
    if isinstance(default, dict | list):
        return f"{override}: the run reads {key}; set what it holds instead"
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{override}: the run reads {key}; set it instead ({key}=..., the default is {shown})"


def _compose_leaving_out_unknown(overrides: list[str], problems: list[str]):
    """The config composed from ``overrides``, and the overrides it was composed from: a key or option that does not
    exist is added to ``problems`` and left out, with the keys under it, until the rest composes. Raises
    ``ConfigError`` with the problems found where nothing is left to leave out."""
    import yaml
    from hydra.errors import ConfigCompositionException, MissingConfigException

    while True:
        try:
            return _compose(overrides), overrides
        except MissingConfigException as e:
            # "Could not find 'memory/amd'" for one option; "Could not load 'memory/acum'" for one of a list
            found = re.search(r"Could not (?:find|load) '([^']+)/([^/']+)'", str(e))
            if not found:
                raise ConfigError("\n".join([*problems, str(e).splitlines()[0]])) from None
            group, name = found.groups()
            options = getattr(e, "options", None) or _options(group)
            problems.append(f"{group}={name}: no such option; {group} is one of {', '.join(options)}")
            wrong = group
        except ConfigCompositionException as e:
            wrong = _composition_problem(e, overrides, problems)
        except yaml.MarkedYAMLError as e:  # a config file of one's own that is not YAML
            mark = e.problem_mark
            where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else "a config file"
            raise ConfigError("\n".join([*problems, f"{where}: {e.problem or e.context}"])) from None
        except UnicodeDecodeError as e:  # (Hydra's reader does not say which file)
            undecodable = next((str(path) for root in [_PRIMARY[0], *_searchpath_folders(overrides)]
                                for path in sorted(root.rglob("*.yaml")) if not _decodes(path)), "a config file")
            raise ConfigError("\n".join([*problems, f"{undecodable}: not UTF-8 text ({e.reason} at byte "
                                                     f"{e.start}); save it as UTF-8"])) from None
        except (ValueError, TypeError) as e:  # what Hydra's defaults list raises on input it does not expect
            raise ConfigError("\n".join([*problems, str(e).splitlines()[0]])) from None
        rest = [o for o in overrides if not _sets(o, wrong)]
        if len(rest) == len(overrides):  # nothing to leave out: what is known so far
            raise ConfigError("\n".join(problems))
        overrides = rest


def _composition_problem(e, overrides: list[str], problems: list[str]) -> str:
    """The key a ``ConfigCompositionException`` is about, its problem added to ``problems``; ``ConfigError`` with
    the problems found where it names no key."""
    from omegaconf.errors import ValidationError

    wrong = getattr(e.__cause__, "full_key", None)
    deleted = re.match(r"Could not delete from config. '([^']+)' does not exist", str(e))
    there = re.match(r"Could not append to config. An item is already at '([^']+)'", str(e))
    if there:  # +seed=5: Hydra's line said what, not what to type
        wrong = there.group(1)
        added = next((o for o in overrides if o.startswith("+") and _sets(o, wrong)), f"+{wrong}")
        problems.append(f"{added}: {wrong} is there already; set it without +: {added.lstrip('+')}")
    elif deleted:  # Hydra takes a key whose value is null for one that does not exist
        wrong = deleted.group(1)
        null = _get(_defaults(tuple(_composing(overrides))), wrong) is None
        problems.append(f"~{wrong}: {wrong} is null already; nothing to delete" if null
                        else _unknown_key(wrong, overrides))
    elif not wrong:
        raise ConfigError("\n".join([*problems, str(e).splitlines()[0]])) from None
    elif isinstance(e.__cause__, ValidationError):  # a typed key (Hydra's, a launcher's): a value of another type
        given = next((o for o in overrides if _sets(o, wrong)), wrong)
        problems.append(f"{given}: {str(e.__cause__).splitlines()[0]}")
    else:
        problems.append(_unknown_key(wrong, overrides))
    return wrong


def _decodes(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
        return True
    except (OSError, UnicodeDecodeError):
        return False


def _group_problem(override: str) -> str | None:
    """A group's option given as Hydra does not take it: ``memory=null``, ``experiment=null`` or
    ``memory=[amp,null]`` (Hydra's traceback: "Config group override must be a string or a list. Got NoneType"),
    ``+memory=amp`` (Hydra's "To override a value use 'override memory: amp'": every group is in the defaults)."""
    key, _, value = override.partition("=")
    if key.startswith("~"):
        return _deleted_group_problem(key[1:])
    group = key.lstrip("+")
    if not value or "." in group or not (CONF / group).is_dir():
        return None
    if _PRIMARY[0] != CONF and not (_PRIMARY[0] / group).is_dir() and not group.startswith("hydra"):
        # a run's saved config (--config-path <run>/.hydra): Hydra took model=base for the string "base"
        return (f"{override}: {_PRIMARY[0] / _PRIMARY[1]}.yaml is composed already, and its folder has no {group} "
                f"options; set {group}'s keys instead ({group}.key=value)")
    if key != group:
        return f"{override}: {group} is chosen without +: {group}={value}"
    if "null" in [v.strip() for v in value.strip("[]").split(",")]:
        default = "no preset" if group in PRESETS else "its default"
        return (f"{override}: a group takes its options ({group} is one of {', '.join(_options(group))}); leave "
                f"{group} out for {default}")
    return None


def _deleted_group_problem(group: str) -> str | None:
    """``~logger``: a group the run reads, deleted (a KeyError traceback once the run began; ``~data`` was taken for
    a mistyped key). The groups whose keys ``conf/train.yaml`` holds (memory), and the presets, may go."""
    if "." in group or group.startswith("hydra") or group in PRESETS or not (CONF / group).is_dir():
        return None
    if group in OmegaConf.load(CONF / "train.yaml"):
        return None
    return (f"~{group}: every run needs an option of {group}; choose one instead ({group} is one of "
            f"{', '.join(_options(group))})")


def _options(group: str) -> list[str]:
    """The options of a config group: its files in conf/<group>/."""
    return sorted(f.stem for f in (CONF / group).glob("*.yaml"))


# mappings whose keys are the user's to name: a spaCy pipeline per language (+tokenizer.models.de=de_core_news_sm),
# keys of one's own kept with the run (+meta.run_name=foo)
OPEN_KEYS = ("tokenizer.models", "meta")


def _open(key: str) -> bool:
    """Whether ``key`` is one of ``OPEN_KEYS`` or under one (``meta.run_name``)."""
    return any(key == k or key.startswith(f"{k}.") for k in OPEN_KEYS)


def _unread_key(override: str, schema: dict, groups: list[str]) -> str | None:
    """A key added with ``+`` (or ``++``) that no option of its group has: nothing would read it, and the run went
    on without it (``+trainer.foo=1``), or failed after the corpus was read (``+model.dmodel=5``)."""
    key = override.split("=")[0].lstrip("+")
    if key.split(".")[0] == "hydra" or "@" in key or (_open(key) and key not in OPEN_KEYS):
        return None  # Hydra's own, a group placed in another package (+model@teacher=base), a mapping's own keys
    if _model_reads(key):
        return None  # an option file of one's own that leaves it to ModelArgs' default
    parts = key.split(".")
    for depth in range(1, len(parts) + 1):  # the first part of the key that the config does not have
        if _get(schema, ".".join(parts[:depth])) is _MISSING:
            missing = ".".join(parts[:depth])
            break
    else:
        return None
    hint = _key_hint(missing, groups)
    if "." not in missing and not hint:  # +run_name=foo: no top-level key is near it
        return f"{override}: nothing reads {missing}; keys of one's own go under meta: +meta.{key}={override.split('=', 1)[1]}"
    return f"{override}: nothing reads {missing}{hint}"


def _unread_by_every_job(jobs: list[list[str]]) -> list[str]:
    """The keys added with + that no job of a sweep reads: ``-m tokenizer=spacy,xlmr ++tokenizer.min_freq=1`` sets
    the spaCy job's key, which the XLM-R job has not (and Hydra lets no job add otherwise)."""
    from hydra.errors import HydraException

    found: dict[str, list[str | None]] = {}
    for job in jobs:
        groups = _composing(job)
        try:
            schema = _defaults(tuple(groups))
        except HydraException:  # reported by the job's own check
            continue
        for override in job:
            if override.startswith("+"):
                found.setdefault(override.split("=")[0], []).append(_unread_key(override, schema, groups))
    return [found_in[0] for found_in in found.values() if len(found_in) == len(jobs) and all(found_in)]


def _sets(override: str, key: str) -> bool:
    """Whether ``override`` sets ``key``, a key under it, or (``key`` a group) the group's option."""
    name = override.split("=")[0].lstrip("+~")
    return name == key or name.startswith(f"{key}.")


PRESETS = ("experiment", "debug")  # groups whose options set other groups' keys


def _group_choice(override: str) -> bool:
    """``model=base``, ``hydra/launcher=slurm``: an option of a config group (a folder of conf/), not a value."""
    key = override.split("=")[0]
    return "=" in override and not override.startswith(("+", "~")) and "." not in key and (CONF / key).is_dir()


def _composing(overrides: list[str]) -> list[str]:
    """The overrides that decide which files compose: the groups' options, and ``hydra.searchpath`` (model=medium
    from /my/conf/model/medium.yaml)."""
    return [o for o in overrides if _group_choice(o)] + _searchpath(overrides)


def _unknown_key(key: str, overrides: list[str]) -> str:
    """The message for a key the config does not have, with the closest key beside it."""
    if _open(key) and key not in OPEN_KEYS:  # meta.run_name=foo
        return f"{key}: not there yet; add it with +: +{key}=..."
    if _model_reads(key):
        return f"{key}: the model option chosen does not set it (ModelArgs' default applies); set it with +{key}=..."
    if others := _options_with_key(key):
        group = key.partition(".")[0]
        return (f"{key}: no such key in the {group} option chosen; it is a setting of "
                f"{' and '.join(f'{group}={o}' for o in others)}")
    return f"{key}: no such key{_key_hint(key, overrides)}"


def _options_with_key(key: str) -> list[str]:
    """The options of a group whose file sets ``key`` (``data.train_size``: data=synthetic's)."""
    group, _, leaf = key.partition(".")
    if not leaf or "." in leaf or not (CONF / group).is_dir():
        return []
    return [Path(f).stem for f in _files_setting(group, leaf) if Path(f).parent.name == group]  # (not presets)


def _model_reads(key: str) -> bool:
    """Whether ``key`` is a model setting (a field of ModelArgs) that a model option file may leave out."""
    group, _, name = key.partition(".")
    if group != "model":
        return False
    from .model import model_fields  # torch (1.5 s): imported only where a model key is looked up

    return name in model_fields()


def _key_hint(key: str, overrides: list[str]) -> str:
    """The closest key beside ``key``, or the keys there are. The keys beside it are those of the options chosen
    (``data=multi30k``): the other overrides may hold more unknown keys."""
    from hydra.errors import HydraException

    parent, _, leaf = key.rpartition(".")
    try:
        tree = _defaults(tuple(_composing(overrides)))
    except HydraException:  # an option that does not exist: reported once this key is fixed
        tree = {}
    node = _get(tree, parent) if parent else {k: v for k, v in tree.items() if k != "hydra"}
    siblings = list(node) if isinstance(node, dict) else []
    if parent == "model":  # and the settings a model option file may leave to ModelArgs' defaults
        from .model import model_fields

        siblings += [f for f in model_fields() if f not in siblings]
    close = difflib.get_close_matches(leaf, siblings, n=1)
    return f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else (
        f"; {parent} has {', '.join(siblings)}" if siblings and parent else "")


_MISSING = object()


def _get(tree, dotted: str):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _check_type(key: str, default, value) -> None:
    if value is None and isinstance(default, bool):  # a flag is on or off (model.tie_embeddings=null ran as false)
        raise ConfigError(f"{key}=null: expected true or false (the default is {str(default).lower()})")
    if default is _MISSING or default is None or value is None or value is _MISSING:
        return
    if any(isinstance(v, str) and v.startswith("${") for v in (value, default)):
        return  # an interpolation (logger.wandb.tags: ${tags}, data.root: ${oc.env:...}): checked when it resolves
    if isinstance(default, list):
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value}: expected a list, e.g. {key}=[{value}]")
        return
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, want = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        typed = str(value).lower() if isinstance(value, bool) else value  # true, as it was typed, not True
        shown = str(default).lower() if isinstance(default, bool) else default
        quote = f"; quote it: '{key}=\"{typed}\"'" if want == "a string" and isinstance(value, (int, float)) else ""
        raise ConfigError(f"{key}={typed}: expected {want} (the default is {shown}){quote}")


def check_presets_are_global(conf: dict) -> None:
    """A preset's file without '# @package _global_' (or one that is not a mapping): its keys landed under
    ``experiment.`` (``debug.``), which nothing reads, and the run trained on the defaults without a word."""
    from hydra.core.hydra_config import HydraConfig

    for group in PRESETS:
        if conf.get(group) in (None, {}):
            continue
        given = conf[group]
        keys = ", ".join(f"{group}.{k}" for k in given) if isinstance(given, dict) else f"{group}: {given!r}"
        choice = HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None
        raise ConfigError(f"{group}={choice or '...'}: its settings landed under {group} ({keys}), which nothing "
                          f"reads: options of {group} set other groups' keys, so their files start with the line "
                          f"'# @package _global_' (as conf/{group}/'s do)")


def check_known_keys(group: str, given, known) -> None:
    """Refuses a key of a config group's option file (or of a preset) that nothing reads: a typo in a file of one's
    own (``encoder_layer``) would otherwise fail deep in a constructor after the corpus is read, and a key of another
    group set from this group's file (``data:`` in conf/memory/) would be lost. The message names the files that set
    it (the command line's keys are checked before: ``check_command_line``)."""
    known = list(known)
    for key in given:
        if key in known:
            continue
        files = _files_setting(group, key)
        where = f" (set in {', '.join(files)})" if files else ""
        if (CONF / key).is_dir():
            hint = (f"{key} is a group of its own: an option of {group} that sets {key} keys needs "
                    f"'# @package _global_' at its top, with its own keys under '{group}:'"
                    + (" (see the package line of conf/memory/tokens.yaml)" if group == "memory" else ""))
        elif close := difflib.get_close_matches(key, known, n=1):
            hint = f"did you mean {group}.{close[0]}?"
        else:
            hint = f"{group} has {', '.join(known)}"
        raise ConfigError(f"{group}.{key}{where}: no such setting; {hint}")


def _files_setting(group: str, key: str) -> list[str]:
    """The config files that set ``group.key``: options of ``group`` (at their top, or under ``group:`` in a global
    package) and presets (under ``group:``)."""
    import yaml

    found = []
    for root, folder in itertools.product(_config_dirs(), (group, *PRESETS)):
        for path in sorted((root / folder).glob("*.yaml")):
            try:
                text = path.read_text(encoding="utf-8")
                tree = yaml.safe_load(text) or {}
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                continue
            if not isinstance(tree, dict):
                continue
            # an option's top-level keys are its group's, but in a global package (presets are all global)
            keys = tree if folder == group and "# @package _global_" not in text else tree.get(group)
            if isinstance(keys, dict) and key in keys:
                found.append(str(path.relative_to(CONF.parent) if root == CONF else path))
    return found


def _config_dirs() -> list[Path]:
    """conf/, then the folders of one's own that Hydra searched for this run (hydra.searchpath, --config-dir)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return [CONF]
    sources = HydraConfig.get().runtime.config_sources
    return [CONF, *(Path(s.path) for s in sources if s.schema == "file" and Path(s.path).resolve() != CONF)]
