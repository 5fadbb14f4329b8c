"""A weight sync between batches never starts while a batch generated ahead of the trainer is still in flight; an
in-flight one (``algorithm.weight_update=in_flight``) does, and reaches every client still generating; with
``trainer.lora.sync=adapter`` every client names the new version's adapter."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from recipes import common
from recipes.grpo import GRPORecipe
from recipes.schedule import InFlight, OneStepAhead


class Client:
    def __init__(self):
        self.versions = []

    def serve_version(self, version, adapter=None):
        self.versions.append(version if adapter is None else (version, adapter))


def bare_recipe(monkeypatch, synced: list, *, in_flight: bool, adapters: bool = False) -> GRPORecipe:
    def sync(self, version, in_flight=False):  # the engines' side: with adapters, the name they loaded
        synced.append((version, in_flight))
        if adapters:
            self.adapter = f"r3rl-policy-v{version}"

    monkeypatch.setattr(common.Recipe, "sync_weights", sync)
    recipe = GRPORecipe.__new__(GRPORecipe)  # only the attributes the guard reads: no engine, no trainer
    recipe.in_flight, recipe.adapter = in_flight, None
    schedule = (InFlight if in_flight else OneStepAhead).__new__(InFlight if in_flight else OneStepAhead)
    schedule.recipe, schedule.ahead = recipe, None  # no producer: the test sets the batch ahead itself
    recipe.schedule = schedule
    recipe.client, recipe.live_clients = Client(), [Client()]
    recipe.evaluator = SimpleNamespace(client=Client())
    return recipe


def test_a_sync_while_the_batch_ahead_generates_is_refused_and_one_after_it_goes_through(monkeypatch):
    """The guard runs before anything touches an engine. Fails if ``GRPORecipe.sync_weights`` or ``OneStepAhead.before_sync`` lost its check (a
    sync during generation would label tokens of two weight versions as one), or if it refused a sync once the
    batch ahead is done (the in-turn path and ``before_eval`` sync then)."""
    synced = []
    recipe = bare_recipe(monkeypatch, synced, in_flight=False)
    running: Future = Future()
    recipe.schedule.ahead = (5, [], running, {})
    with pytest.raises(RuntimeError, match="batch of step 5 is still generating"):
        recipe.sync_weights(version=4)
    assert synced == []
    running.set_result(([], 0.0))
    recipe.sync_weights(version=4)
    recipe.schedule.ahead = None
    recipe.sync_weights(version=5)
    assert synced == [(4, False), (5, False)]
    assert recipe.client.versions == [] and recipe.live_clients[0].versions == []  # no salts between batches


def test_an_in_flight_sync_goes_under_the_batch_ahead_and_every_live_client_takes_the_version(monkeypatch):
    """Fails if the in-flight sync were refused while the batch generates (the mode would wait as between batches),
    or if a client still generating kept the old version (its later requests would reuse older prefix blocks
    uncounted), or if the evaluator's client did (an eval point after the update could be served blocks the older
    weights computed: issue 58; that a salted request never reuses them is test_weight_update.py's)."""
    synced = []
    recipe = bare_recipe(monkeypatch, synced, in_flight=True)
    recipe.schedule.ahead = (5, [], Future(), {})
    recipe.sync_weights(version=4, in_flight=True)
    assert synced == [(4, True)]
    assert recipe.client.versions == [4] and recipe.live_clients[0].versions == [4]
    assert recipe.evaluator.client.versions == [4]


def test_an_adapter_sync_between_batches_makes_every_client_name_the_new_adapter(monkeypatch):
    """``trainer.lora.sync=adapter``: after the sync every client, the evaluator's too, sends the version's adapter
    name and counts its samples as of that version. Fails if a client kept naming the previous adapter or the base
    (its samples would be labelled with a version whose weights did not generate them, and an eval point would
    score the old policy)."""
    synced = []
    recipe = bare_recipe(monkeypatch, synced, in_flight=False, adapters=True)
    recipe.sync_weights(version=3)
    assert synced == [(3, False)]
    for client in (recipe.client, recipe.live_clients[0], recipe.evaluator.client):
        assert client.versions == [(3, "r3rl-policy-v3")]
