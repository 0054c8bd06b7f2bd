"""``herd worker --lora-modules``: vLLM's NAME=PATH pairs."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd.cli.worker import lora_modules


def test_pairs_become_a_name_to_folder_map() -> None:
    assert lora_modules(["sql=/a/sql", "poet=rel/poet"]) == {"sql": Path("/a/sql"), "poet": Path("rel/poet")}


@pytest.mark.parametrize("value", ["sql", "=/a", "sql="], ids=["no-equals", "no-name", "no-path"])
def test_a_pair_without_name_or_path_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_modules([value])
