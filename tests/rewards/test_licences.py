"""docs/rewards.md's Licences table has a row for every reward a user downloads weights for: each registered reward
whose builder takes `weights=` (read from its signature; no model is built or loaded)."""

import inspect
import re
from pathlib import Path

from mmrl.rewards import registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def licence_rows(text: str) -> dict[str, list[str]]:
    """{reward name: [code, weights, base model] cells} of the table after the `**Licences**` paragraph; a row's
    first cell names its rewards in backticks."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("**Licences**")), None)
    assert start is not None, f"{DOC}: no paragraph starting with '**Licences**' (the licence table's lead-in)"
    table = []
    for ln in lines[start + 1:]:
        if ln.startswith("|"):
            table.append(ln)
        elif table:  # the first non-table line after the table ends it
            break
    rows = {}
    for ln in table[2:]:  # header and |---| rule
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            rows[name] = cells[1:]
    return rows


def weights_rewards() -> set[str]:
    """Registered names whose builder takes a `weights` argument."""
    return {n for n in registry.available() if "weights" in inspect.signature(registry.lookup(n)).parameters}


def test_every_reward_that_takes_weights_has_a_licence_row():
    rows = licence_rows(DOC.read_text())
    learned = weights_rewards()
    # the brief's list must be among them: a registry change that hides one would make this test vacuous
    assert {"pickscore", "clip_score", "hpsv2", "hpsv21", "aesthetic", "imagereward", "hpsv3", "unified_reward",
            "dina_lrm", "lpo_lrm", "edit_reward", "videoalign"} <= learned
    missing = sorted(learned - set(rows))
    assert not missing, (f"docs/rewards.md: the Licences table has no row for {missing}, rewards that take "
                         f"weights=; add one with the code, weights and base-model licences and their sources")
    unknown = sorted(set(rows) - set(registry.available()))
    assert not unknown, f"docs/rewards.md: the Licences table names {unknown}, which are not registered rewards"
    for name in learned:
        assert len(rows[name]) == 3 and all(rows[name]), f"docs/rewards.md Licences row of '{name}': empty cell"
    assert "not checked here" not in DOC.read_text()
