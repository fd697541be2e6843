"""``--opts KEY VALUE ...`` taken out of a command line before argparse reads the rest.

argparse reads any argument that starts with '-' and is not a plain negative number as an option,
so ``--opts OPTIMIZER.EPS -1e-8`` (or ``-inf``, or a value like ``-x``) stopped at the value with
"unrecognized arguments" naming neither the key nor the fix. Here the argument after a key is its
value unless it is one of the command's own flags: then the key has no value, and ``apply_opts``
names it. An argument in a key's place that starts with '-' ends the pairs and is left to argparse.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence

OPTS_FLAG = "--opts"


def parse_arguments(
    parser: argparse.ArgumentParser, commands: Mapping[str, argparse.ArgumentParser], arguments: Sequence[str]
) -> argparse.Namespace:
    """``arguments`` read by ``parser``, whose sub-commands are ``commands``, the named command's
    ``--opts`` pairs read by ``take_opts``."""
    at = next((i for i, argument in enumerate(arguments) if not argument.startswith("-")), None)
    command = commands.get(arguments[at]) if at is not None else None
    if at is None or command is None or OPTS_FLAG not in command._option_string_actions:
        return parser.parse_args(arguments)
    rest, opts = take_opts(arguments[at + 1 :], command._option_string_actions)
    args = parser.parse_args([*arguments[: at + 1], *rest])
    if opts is not None:
        args.opts = opts
    return args


def take_opts(arguments: Sequence[str], flags: Collection[str]) -> tuple[list[str], list[str] | None]:
    """``arguments`` (a command's, after its name) without the ``--opts`` pairs, and those pairs
    (of every ``--opts``, in order; None without ``--opts``). ``flags``: the command's option
    strings, which argparse also accepts abbreviated to a unique prefix."""
    longs = [flag for flag in flags if flag.startswith("--")]

    def flag_of(argument: str) -> str | None:
        name = argument.split("=", 1)[0]
        if name in flags:
            return name
        matches = [flag for flag in longs if flag.startswith(name)] if len(name) > 2 else []
        return matches[0] if name.startswith("--") and len(matches) == 1 else None

    rest: list[str] = []
    opts: list[str] | None = None
    at = 0
    while at < len(arguments):
        argument = arguments[at]
        at += 1
        if flag_of(argument) != OPTS_FLAG:
            rest.append(argument)
            continue
        pairs = [argument.split("=", 1)[1]] if "=" in argument else []
        while at < len(arguments):
            following = arguments[at]
            if len(pairs) % 2 == 0 and following.startswith("-"):
                break  # not a key: a flag, or what argparse is to refuse
            if len(pairs) % 2 == 1 and flag_of(following) is not None:
                break  # the key before has no value
            pairs.append(following)
            at += 1
        if not pairs:
            rest.append(argument)  # argparse says it expects at least one argument
        opts = [*(opts or []), *pairs]
    return rest, opts
