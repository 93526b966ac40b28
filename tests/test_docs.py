"""Docs generated from code stay in step with it."""

from __future__ import annotations

from pathlib import Path

from jupyter_ext.configdoc import render

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_current() -> None:
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert current == render(), "run: python -m jupyter_ext.configdoc > docs/configuration.md"


def test_every_option_says_its_default() -> None:
    from jupyter_ext.app import SnapshotExtensionApp

    for name, trait in SnapshotExtensionApp.class_own_traits(config=True).items():
        assert "Default" in (trait.help or ""), f"{name}: its help must state the default"
