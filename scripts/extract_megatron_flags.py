"""Extract the flag list of Megatron-LM's argument parser into a JSON fixture.

Builds Megatron-LM's parser (``megatron.training.arguments.add_megatron_arguments``) from a
Megatron-LM checkout and records, for every flag: its option strings, ``dest``, whether it takes a
value, its default and its argument-group title. Megatron-LM 0.16 generates about half of its
flags from dataclasses (``ArgumentGroupFactory`` over ``TransformerConfig``, ``TrainingConfig``,
...), so reading ``add_argument`` calls with ``ast`` misses them; the parser itself is the list.
Nothing of Megatron-LM is copied into this repository; only the flag table is written.

``megatron.training``'s package ``__init__`` pulls in the training loop (Triton kernels, global
state); this script registers an empty package in its place so only ``arguments.py`` and the
config dataclasses it needs are imported (from the checkout, with the checkout's megatron.core).

Run (writes ``tests/fixtures/megatron_lm_flags_<tag>.json``, read by
``tests/unit/test_megatron_flag_coverage.py``)::

    git -C <Megatron-LM> archive core_v0.16.1 megatron | tar -x -C /tmp/mlm
    python scripts/extract_megatron_flags.py /tmp/mlm --version core_v0.16.1 \
        --commit $(git -C <Megatron-LM> rev-parse 'core_v0.16.1^{commit}')
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path


def megatron_lm_parser(checkout: Path) -> argparse.ArgumentParser:
    """Megatron-LM's own parser, built from ``checkout`` (the directory holding ``megatron/``)."""
    sys.path.insert(0, str(checkout))
    package = types.ModuleType("megatron.training")
    package.__path__ = [str(checkout / "megatron" / "training")]
    for name in ("get_args", "get_timers", "get_adlr_autoresume"):  # names utils.py imports
        setattr(package, name, None)
    sys.modules["megatron.training"] = package
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    return add_megatron_arguments(parser)


def _json_default(value: object) -> object:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(
        v is None or isinstance(v, (bool, int, float, str)) for v in value
    ):
        return list(value)
    return f"<{value!r}>"


def flag_table(parser: argparse.ArgumentParser) -> list[dict[str, object]]:
    """One record per flag of ``parser``, in declaration order."""
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    flags = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        longs = [o for o in action.option_strings if o.startswith("--")] or action.option_strings
        flags.append(
            {
                "flag": longs[0],
                "aliases": [o for o in action.option_strings if o != longs[0]],
                "dest": action.dest,
                "takes_value": action.nargs != 0,
                "nargs": action.nargs,
                "default": _json_default(action.default),
                "group": group_of.get(id(action)),
            }
        )
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="directory holding Megatron-LM's megatron/")
    parser.add_argument("--version", required=True, help="Megatron-LM tag, e.g. core_v0.16.1")
    parser.add_argument("--commit", required=True, help="commit of that tag")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    flags = flag_table(megatron_lm_parser(args.checkout.resolve()))
    out = args.out or Path(__file__).resolve().parents[1] / (
        f"tests/fixtures/megatron_lm_flags_{args.version}.json"
    )
    doc = {
        "source": "NVIDIA/Megatron-LM megatron/training/arguments.py (add_megatron_arguments)",
        "version": args.version,
        "commit": args.commit,
        "generator": "scripts/extract_megatron_flags.py",
        "flags": flags,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(flags)} flags -> {out}")


if __name__ == "__main__":
    main()
