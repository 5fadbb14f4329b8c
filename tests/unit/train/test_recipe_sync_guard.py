"""A weight sync never starts while a batch generated ahead of the trainer is still in flight."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from recipes import common
from recipes.grpo import GRPORecipe


def test_a_sync_while_the_batch_ahead_generates_is_refused_and_one_after_it_goes_through(monkeypatch):
    """The guard runs before anything touches an engine. Fails if ``GRPORecipe.sync_weights`` lost its check (a
    sync during generation would label tokens of two weight versions as one), or if it refused a sync once the
    batch ahead is done (the in-turn path and ``before_eval`` sync then)."""
    synced = []
    monkeypatch.setattr(common.Recipe, "sync_weights", lambda self, version: synced.append(version))
    recipe = GRPORecipe.__new__(GRPORecipe)  # only the attribute the guard reads: no engine, no trainer
    running: Future = Future()
    recipe.ahead = (5, [], running, {})
    with pytest.raises(RuntimeError, match="batch of step 5 is still generating"):
        recipe.sync_weights(version=4)
    assert synced == []
    running.set_result(([], 0.0))
    recipe.sync_weights(version=4)
    recipe.ahead = None
    recipe.sync_weights(version=5)
    assert synced == [4, 5]
