"""The configuration reference is generated from the models, and kept in step with them."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from hicache.registry import tier_types
from hicache.tools import docgen

ROOT = Path(__file__).resolve().parent.parent


def test_the_configuration_reference_is_current():
    on_disk = (ROOT / "docs" / "configuration.md").read_text()
    assert on_disk == docgen.render(), (
        "docs/configuration.md is stale: run python -m hicache.tools.docgen > docs/configuration.md"
    )


def test_the_reference_lists_every_field_of_every_tier_type():
    text = docgen.render()
    for name, model in tier_types().items():
        section = text.split(f"## `tiers:` item `type: {name}`\n", 1)[1].split("\n## ", 1)[0]
        rows = [line.split("|")[1].strip() for line in section.splitlines() if line[:3] == "| `"]
        assert rows == [f"`{f}`" for f in model.model_fields if f != "type"]


class _Documented(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    size: int = 1 << 20
    """How large."""
    kind: str = ""
    """Which one."""
    left_out: int = 0


def test_a_field_without_a_docstring_is_refused_by_name():
    with pytest.raises(ValueError, match=r"_Documented\.left_out has no docstring"):
        docgen._section("x", _Documented, "")


def test_a_field_row_gives_type_default_and_meaning():
    class Sized(_Documented):
        left_out: int = 0
        """Given now."""

    rows = docgen._section("x", Sized, "s.").splitlines()
    assert rows[-3:] == [
        "| `s.size` | int | `1048576` | How large. |",
        '| `s.kind` | str | `""` | Which one. |',
        "| `s.left_out` | int | `0` | Given now. |",
    ]
