"""The `pagedserve` command: `pagedserve serve [flags]` starts a whole engine group (like
`vllm serve`); the flags are the launcher's (`pagedserve serve --help`)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: pagedserve serve [--model NAME_OR_PATH] [flags ...]\n\n"
              "commands:\n  serve    start the engine group and its OpenAI-compatible HTTP "
              "server\n\n`pagedserve serve --help` lists the flags.")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command != "serve":
        print(f"pagedserve: unknown command {command!r} (try `pagedserve serve --help`)",
              file=sys.stderr)
        return 2
    if rest and not rest[0].startswith("-"):  # `pagedserve serve MODEL ...`, as vLLM takes it
        rest = ["--model", rest[0], *rest[1:]]
    from pagedserve.pipeline.launch import main as launch
    return launch(rest)


if __name__ == "__main__":
    sys.exit(main())
