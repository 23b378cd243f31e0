"""The model catalog (actors/common/model_catalog.py) says of each family what its module in
actors/engine/models/ builds, and reads so without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ringserve.actors.common.model_catalog import (EXPERT_FAMILIES, FAMILIES, VISION_FAMILIES, family_has_experts,
                                                   family_of)
from ringserve.actors.engine.models.causal_lm import VISION_MODELS
from ringserve.actors.engine.models.spec import spec_of

REPO = Path(__file__).resolve().parents[2]


def test_the_vision_families_are_the_ones_the_engine_builds() -> None:
    assert set(VISION_FAMILIES) <= FAMILIES.keys()
    assert set(VISION_MODELS) == set(VISION_FAMILIES)


def test_the_families_with_experts_are_the_ones_whose_spec_declares_them() -> None:
    assert set(EXPERT_FAMILIES) <= FAMILIES.keys()
    for family in FAMILIES.keys() - set(VISION_FAMILIES):
        assert family_has_experts(family) == (spec_of(family).moe is not None), family


def test_the_catalog_imports_no_torch() -> None:
    code = ("import sys; from ringserve.actors.common.model_catalog import family_has_experts, family_of; "
            "print(family_of({'architectures': ['MixtralForCausalLM']}), family_has_experts('mixtral'), "
            "[n for n in ('torch', 'transformers') if n in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mixtral", "True", "[]"]
    assert family_of({"architectures": ["MixtralForCausalLM"]}) == "mixtral"
