"""The `hicache` command.

    hicache config check FILE     validate a configuration (--strict: and that it fits here)
    hicache config check --kv-transfer-config JSON   the same for vLLM's connector argument
    hicache trace FILE ...        replay a request trace through the cache; --sweep, the
                                  planner (--model, --tier) and --instances are its modes
    hicache trace import DIR OUT  turn a folder of kv-cache-tester sessions into a trace
    hicache replay ...            multi-turn replay on the reference engine (refengine)
    hicache COMMAND --help        a command's options

Subcommands other than `config` are found through the ``hicache.commands`` entry-point group, so
packages built on hicache (such as the reference engine) add commands without hicache importing
them. A ConfigError a subcommand raises (a configuration that cannot be used, or a tier of it that
cannot start here) is one line on stderr and exit status 2. ``--version`` and every ``--help``
answer without importing torch (each command imports what it runs only once its arguments are
parsed).
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from hicache import __version__


def _config_check(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="hicache config check",
        description="Validate a hicache YAML file (exit 2 if it is not valid). What does not fit "
        "this machine (memory, CPUs, a disk directory) is a warning, an error with --strict.",
    )
    ap.add_argument("file", nargs="?")
    ap.add_argument(
        "--strict", action="store_true", help="also fail (exit 2) where it does not fit here"
    )
    ap.add_argument(
        "--kv-transfer-config", metavar="JSON", help="instead of FILE: vLLM's argument of that "
        "name, checked as hicache's connector will check it (its extra config and the hicache "
        "config it names)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if (args.file is None) == (args.kv_transfer_config is None):
        ap.error("give FILE or --kv-transfer-config")
    import yaml

    from hicache.config import ConfigError, load_config

    try:
        if args.file is not None:
            config, where = load_config(args.file), args.file
        else:
            from hicache.integrations.vllm.settings import from_transfer_config

            config, where = from_transfer_config(args.kv_transfer_config).config, ""
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    problems = config.machine_problems(where)
    for problem in problems:
        print(f"{'error' if args.strict else 'warning'}: {problem}", file=sys.stderr)
    return 2 if problems and args.strict else 0


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group="hicache.commands")}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugins()
    usage = (
        "usage: hicache [--version] config check FILE | hicache {"
        + ",".join(sorted(plugins))
        + "} ..."
    )
    if not argv or argv[0] in ("-h", "--help"):
        doc = (__doc__ or "").splitlines()
        commands = [line[4:] for line in doc if line.startswith("    ")]
        print(usage + "\n\n" + "\n".join(commands))
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"hicache {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "config":
        if rest[:1] in (["-h"], ["--help"]):
            return _config_check(["--help"])
        if not rest or rest[0] != "check":
            print(
                "usage: hicache config check FILE | hicache config check --kv-transfer-config JSON",
                file=sys.stderr,
            )
            return 2
        return _config_check(rest[1:])
    if command in plugins:
        from hicache.config import ConfigError

        try:
            return int(plugins[command].load()(rest) or 0)  # type: ignore[attr-defined]
        except ConfigError as err:  # e.g. a tier that cannot start here: one line, no traceback
            print(f"hicache {command}: {err}", file=sys.stderr)
            return 2
    print(f"hicache: unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
