"""The configuration reference (docs/configuration.md), generated from the traits.

python -m jupyter_ext.configdoc > docs/configuration.md
"""

from __future__ import annotations

import inspect

from traitlets import TraitType

from .settings import options

#: Traits whose default is computed at start (see their help).
COMPUTED = ("owner", "local_store_dir", "work_dir", "encryption_key_file")


def _default(trait: TraitType[object, object]) -> str:
    return "computed (see help)" if trait.name in COMPUTED else trait.default_value_repr()


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the traits of `jupyter_ext.settings.SnapshotSettings` (the options of",
        "`SnapshotExtensionApp`, configured under its name) by",
        "`python -m jupyter_ext.configdoc`. Set them in `jupyter_server_config.py`",
        "(`c.SnapshotExtensionApp.periodic_interval = 600`) or on the command line",
        "(`--SnapshotExtensionApp.periodic_interval=600`).",
        "",
    ]
    traits = options()
    for name in sorted(traits):
        trait = traits[name]
        help_text = inspect.cleandoc(trait.help or "")
        lines += [
            f"## `SnapshotExtensionApp.{name}`",
            "",
            f"{type(trait).__name__}, default `{_default(trait)}`.",
            "",
            help_text,
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
