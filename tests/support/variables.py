"""SLOTKEEPER_* environments for settings tests, spelled by hand (not with the code under test's
`env_name`), so that a test still pins each variable's name: `slotkeeper_env(parallel="3")` is
`{"SLOTKEEPER_PARALLEL": "3"}`."""

from __future__ import annotations


def slotkeeper_env(**values: str) -> dict[str, str]:
    return {f"SLOTKEEPER_{name.upper()}": value for name, value in values.items()}
