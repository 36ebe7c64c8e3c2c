"""Errors that are the user's to fix: each problem reported as one line that names the key, file or line, never
as a traceback (an error that reports several problems has a line for each)."""

import math


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
        raise ConfigError(f"{key}={value}: must be an integer >= {minimum}" + (", or null" if nullable else "")
                          + string_hint(key, value))


def check_number(key: str, value, minimum: float, strict: bool = False, nullable: bool = False, why: str = "",
                 below: float | None = None) -> None:
    """A setting that must be a number of at least ``minimum`` (above it, where ``strict``; below ``below``, where
    given; or null, where ``nullable``); ``why`` ends the message."""
    if nullable and value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value}: must be a finite number")
    if (isinstance(value, bool) or not isinstance(value, int | float) or value < minimum
            or (strict and value == minimum) or (below is not None and value >= below)):
        raise ConfigError(f"{key}={value}: must be a number {'>' if strict else '>='} {minimum}"
                          + (f" and < {below}" if below is not None else "") + (", or null" if nullable else "") + why
                          + string_hint(key, value))


def string_hint(key: str, value) -> str:
    """For a number given as a string: an environment variable's value is one (``${oc.env:STEPS}`` gives '300')."""
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:  # a word: no environment variable's number
        return ""
    return f" ('{value}' is a string: read an environment variable as a number with '{key}=\"${{oc.decode:${{oc.env:NAME}}}}\"')"


class DataError(UserError):
    pass


class NumericalError(UserError):
    """NaN or infinite losses or gradients beyond what trainer.on_nonfinite allows."""
