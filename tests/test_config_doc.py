"""docs/config.md is generated from the config models (`ops.config_doc`): it must be what the
generator writes now, and every key must have a description to write."""

from __future__ import annotations

from ops import config_doc


def test_docs_config_md_is_up_to_date() -> None:
    assert config_doc.DOC.read_text() == config_doc.render(), (
        "docs/config.md is out of date: run `python -m ops.config_doc > docs/config.md`"
    )


def test_every_config_key_is_documented() -> None:
    assert config_doc.undocumented() == []  # a docstring under each field


def test_the_reference_has_every_section_and_engine() -> None:
    text = config_doc.render()
    for heading in (
        "### Run config: `streams`",
        "### Run config: `rollout.engine` with `type: vllm`",
        "### Run config: `trainer.engine` with `type: megatron`",
        "### Fleet config: `roles.<name>`",
    ):
        assert heading in text
    assert "| `lr` | float (> 0) | `0.0003` | AdamW learning rate. |" in text
