"""docs/configuration.md is what tools/config_docs.py generates from the config models (`make config-docs`), so a
field is documented in one place, its model, and the page follows every field added, renamed or re-described."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import config_docs  # noqa: E402  (tools/config_docs.py: what `make config-docs` runs)

from app.config import TrainingConfig  # noqa: E402


def test_the_page_is_current():
    diff = config_docs.differences()
    assert not diff, (
        "docs/configuration.md differs from what the config models say: run `make config-docs` "
        "(python tools/config_docs.py --write) and commit the page.\n" + "\n".join(diff[:80])
    )


def leaf_paths(model: type, prefix: str = "") -> list[str]:
    """Every field's dotted path, descending into the sections (models) of app.config."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        inner = [a for a in (field.annotation, *getattr(field.annotation, "__args__", ())) if isinstance(a, type)]
        section = next((a for a in inner if hasattr(a, "model_fields") and a.__module__ == "app.config"), None)
        if section is not None:
            paths += leaf_paths(section, f"{path}.")
    return paths


def test_every_field_has_a_row_and_every_section_a_table():
    page = config_docs.render()
    paths = leaf_paths(TrainingConfig)
    assert len(paths) > 60, paths
    missing = [path for path in paths if "." in path and f"| `{path}` |" not in page]
    assert not missing, f"fields without a row: {missing}"
    assert [path for path in paths if "." not in path] == list(TrainingConfig.model_fields)
    for section in ("experiment", "model", "model.lora", "data", "train", "checkpoint", "scaling", "deepspeed"):
        assert f"\n## {section}\n" in page, section
    for path in ("deepspeed.zero_optimization", "deepspeed.zero_optimization.stage"):
        assert f"`{path}`" in page


def test_a_row_says_type_bounds_default_and_description():
    page = config_docs.render()
    row = next(line for line in page.splitlines() if line.startswith("| `train.micro_batch_size` |"))
    assert row.startswith(
        "| `train.micro_batch_size` | integer (>= 1, <= 65536) or `auto` | `1` | Sequences per worker per forward "
        "pass. auto: the largest power of two"
    )
    assert "| `experiment.on_conflict` | one of `fail`, `wait` | `fail` |" in page
    assert "| `model.lora` | section [`model.lora`](#modellora) or null | `null` |" in page


def test_check_mode_names_the_command(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text(config_docs.render().replace("Sequences per worker", "Rows per worker"))
    assert config_docs.main(["--check", "--out", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "Rows per worker" in err and "run `make config-docs`" in err
    assert config_docs.main(["--write", "--out", str(stale)]) == 0
    assert config_docs.main(["--check", "--out", str(stale)]) == 0


@pytest.mark.parametrize("name", ["model", "train"])
def test_a_new_field_appears_after_a_rewrite(monkeypatch, name):
    """A field added to a section later gets its row with no change to the generator."""
    from pydantic import Field, create_model

    from app import config

    section = getattr(config, {"model": "ModelConfig", "train": "TrainConfig"}[name])
    extended = create_model(
        section.__name__, __base__=section, new_knob=(int, Field(7, ge=0, description="A knob added later."))
    )
    root = create_model("TrainingConfig", __base__=TrainingConfig, **{name: (extended, extended())})
    monkeypatch.setattr(config_docs, "TrainingConfig", root)
    monkeypatch.setattr(config_docs, "training_schema", lambda: _schema_of(root), raising=True)
    page = config_docs.render()
    assert f"| `{name}.new_knob` | integer (>= 0) | `7` | A knob added later. |" in page


def _schema_of(root):
    from app import schema

    schema_doc = schema._simplify(root.model_json_schema(mode="validation"))
    return schema_doc, schema_doc.pop("$defs")
