"""``python -m calibration {pask} ...``: build a frozen table artifact."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"pask": "calibration.pask"}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m calibration {{{','.join(commands)}}} --model PATH --out DIR [options]\n"
              f"       python -m calibration pask --help", file=sys.stderr)
        return 2
    import importlib
    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
