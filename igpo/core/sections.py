"""Reading one ``algorithm.<name>`` section of the run config into a config dataclass, the same way for every method
whose section follows this rule: unknown keys are refused with the known ones, a null keeps the field's default, and
an integer given for a float field (YAML and the command line write 1 where 1.0 is meant) becomes a float."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any


def section_values(cls: type, section: Mapping[str, Any], name: str, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The keyword arguments for dataclass ``cls`` from the ``algorithm.<name>`` mapping ``section``; ``exclude``:
    fields that are set from elsewhere in the config and are not keys of the section."""
    excluded = set(exclude)
    known = [f.name for f in fields(cls) if f.name not in excluded]
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) algorithm.{name}.{unknown}: check the spelling; known keys are {known} "
                         "(see configs/igpo_base.yaml).")
    values = {}
    for key, value in section.items():
        if value is None:
            continue
        if isinstance(getattr(cls, key), float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        values[key] = value
    return values
