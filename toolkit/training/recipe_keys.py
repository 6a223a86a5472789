"""Every key of both recipes' configs, and each table its consumers read, derived from what the keys' fields declare.

A key is declared once, on its field (toolkit.config.declarations); a recipe's code reads its own config's
declarations, and these are the views of both recipes together that the tests walk and the docs cite.
"""

from __future__ import annotations

from toolkit.config import declarations as said
from toolkit.config.declarations import CheckedBy, Need, declared, undeclared
from toolkit.run.paths import overlaps
from toolkit.training.recipe_config import FinetuneConfig, PretrainConfig

RECIPES = (PretrainConfig, FinetuneConfig)

# where a run reads and writes: {text key: OUTPUT, CACHE, READ, RESUME, or None for text that is no path}
PATH_SETTINGS: dict[str, str | None] = declared(RECIPES, "path")
OVERLAPS = overlaps(PATH_SETTINGS)

# what a resume does with a change since its checkpoint (toolkit.checkpoint.settings)
ON_RESUME = declared(RECIPES, "resume")
REFUSED = {key: r.why for key, r in ON_RESUME.items() if r.kind == "refused"}
FREE = {key: r.why for key, r in ON_RESUME.items() if r.kind == "free"}
OWN_CHECK, SCHEDULE, FROM_NEXT_STEP, KEPT_BY_THE_OPTIMIZER = (
    tuple(key for key, r in ON_RESUME.items() if r == kind)
    for kind in (said.OWN_CHECK, said.SCHEDULE, said.FROM_NEXT_STEP, said.KEPT_BY_THE_OPTIMIZER))

# when a key has an effect (toolkit.training.unused)
_USED = declared(RECIPES, "used_when")
USED_WHEN = {key: need for key, need in _USED.items() if isinstance(need, Need) or callable(need)}
CHECKED_BY = {key: need.where for key, need in _USED.items() if isinstance(need, CheckedBy)}
ALWAYS = tuple(key for key, need in _USED.items() if need == said.ALWAYS)

# whether a list may name an entry twice: refused where it would do a thing twice or mean nothing
UNIQUE = tuple(key for key, unique in declared(RECIPES, "unique").items() if unique)
REPEATS_MEAN_SOMETHING = tuple(key for key, unique in declared(RECIPES, "unique").items() if not unique)

# the edge values of each key a run takes, and why (tests/toolkit/config/test_values.py refuses the others)
ACCEPTS: dict[str, dict[str, str]] = declared(RECIPES, "accepts")


def unclassified() -> list[str]:
    """One line for each key of either recipe that leaves out a declaration (toolkit.config.declarations.undeclared)."""
    return list(dict.fromkeys(line for cls in RECIPES for line in undeclared(cls)))
