"""Errors that are the user's to fix: each problem reported as one line that names the key, file or line, never
as a traceback (an error that reports several problems has a line for each)."""


class UserError(Exception):
    """A problem with the configuration or the data, with a message that says what to change."""


class ConfigError(UserError):
    pass


def error_lines(e: UserError) -> str:
    """The error as printed: ``error: <problem>``, a line for each problem it reports."""
    return "\n".join(f"error: {problem}" for problem in str(e).splitlines())


def check_int(key: str, value, minimum: int, nullable: bool = False) -> None:
    """A setting that must be an integer of at least ``minimum`` (or null, where ``nullable``)."""
    if nullable and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{key}={value}: must be an integer >= {minimum}" + (", or null" if nullable else ""))


def check_number(key: str, value, minimum: float, strict: bool = False, nullable: bool = False, why: str = "",
                 below: float | None = None) -> None:
    """A setting that must be a number of at least ``minimum`` (above it, where ``strict``; below ``below``, where
    given; or null, where ``nullable``); ``why`` ends the message."""
    if nullable and value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, int | float) or value < minimum or (strict and value == minimum)
            or (below is not None and value >= below)):
        raise ConfigError(f"{key}={value}: must be a number {'>' if strict else '>='} {minimum}"
                          + (f" and < {below}" if below is not None else "") + (", or null" if nullable else "") + why)


class DataError(UserError):
    pass


class NumericalError(UserError):
    """NaN or infinite losses or gradients beyond what trainer.on_nonfinite allows."""


def check_known_keys(group: str, given, known, option_file=None) -> None:
    """Refuses a key of a config group's option file (or of a preset) that nothing reads: a typo in a file of one's
    own (``encoder_layer``) would otherwise fail deep in a constructor after the corpus is read, or a key of another
    group set from this group's file (``data:`` in conf/memory/) would be lost. ``option_file``: the file the option
    was read from, named when it holds the key."""
    import difflib
    from pathlib import Path

    from .config_check import CONF

    known = list(known)
    for key in given:
        if key in known:
            continue
        path = Path(option_file) if option_file else None
        where = f" (in {_shown(path, CONF.parent)})" if path and _sets_key(path, group, key) else ""
        if (CONF / key).is_dir():
            hint = (f"{key} is a group of its own: an option of {group} that sets {key} keys needs "
                    f"'# @package _global_' at its top, with its own keys under '{group}:' (see conf/memory/tokens.yaml)")
        elif close := difflib.get_close_matches(key, known, n=1):
            hint = f"did you mean {group}.{close[0]}?"
        else:
            hint = f"{group} has {', '.join(known)}"
        raise ConfigError(f"{group}.{key}{where}: no such setting; {hint}")


def _sets_key(path, group: str, key: str) -> bool:
    """Whether the YAML file at ``path`` sets ``key``: at its top level, or under ``group:`` in a global package."""
    import yaml

    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(tree, dict) and (key in tree or key in (tree.get(group) or {}))


def _shown(path, root) -> str:
    """``path`` as the user knows it: relative to the repository where it is in it."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
