"""The installed Megatron's RouterReplay API is the one the replay driver speaks (pitfall P16)."""

from __future__ import annotations

import pytest

from r3rl.train.replay import check_megatron_api


def test_installed_megatron_replay_api_is_supported():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    before = list(RouterReplay.global_router_replay_instances)
    check_megatron_api()
    assert RouterReplay.global_router_replay_instances == before  # the probe instance is not left behind


def test_a_changed_replay_signature_is_refused(monkeypatch):
    # Another Megatron release cannot be installed next to the pinned one; only its changed signature is faked.
    from megatron.core.transformer.moe.router_replay import RouterReplay

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None, extra=0):
        raise NotImplementedError

    monkeypatch.setattr(RouterReplay, "get_replay_topk", get_replay_topk)
    with pytest.raises(RuntimeError, match="RouterReplay API changed"):
        check_megatron_api()
