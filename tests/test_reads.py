"""data.eval_fraction's holdout (app.data.pipeline.holdout): rows picked by the seed and the row count only."""

from __future__ import annotations

import numpy as np
from test_prepare import chat_config

from app.data import pipeline


def test_the_held_out_rows_depend_on_the_seed_and_the_rows_only(tiny_model, tmp_path):
    """data.eval_fraction's rows: datasets' count (ceil), both parts in the split's order, the same for a seed
    every time, others for another seed; the rule is in the key of a config that holds rows out, and only there."""
    kept, held = pipeline.holdout(600, 0.1, 42)
    assert len(held) == 60 and len(kept) == 540 and sorted({*kept, *held}) == list(range(600))
    assert list(held) == sorted(held) and list(kept) == sorted(kept)
    again, other = pipeline.holdout(600, 0.1, 42)[1], pipeline.holdout(600, 0.1, 7)[1]
    assert np.array_equal(again, held) and not np.array_equal(other, held)
    assert len(pipeline.holdout(7, 0.25, 0)[1]) == 2
    fraction = chat_config(tmp_path, tiny_model, eval_fraction=0.1)
    assert pipeline.key_fields(fraction)["holdout"] == pipeline.HOLDOUT
    assert "holdout" not in pipeline.key_fields(chat_config(tmp_path, tiny_model))
    monkey = pipeline.key_of(fraction)
    pipeline.HOLDOUT, rule = "another-rule", pipeline.HOLDOUT
    try:
        assert pipeline.key_of(fraction) != monkey
    finally:
        pipeline.HOLDOUT = rule
