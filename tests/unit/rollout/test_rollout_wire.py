"""``/inference/v1/generate`` responses -> ``Sample``, with hand-made bodies: status from finish_reason first,
lengths, masks, weight versions, request bodies and seeds."""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest

from r3rl.config.schema import SamplingConfig
from r3rl.rollout.errors import EngineError
from r3rl.rollout.routed_experts import RoutedExpertsError, RouteSpec, encode_routed_experts
from r3rl.rollout.wire import parse_choices, parse_response, request_body, sample_seed, samples_from_body
from r3rl.sample import SampleStatus

SPEC = RouteSpec(num_layers=2, topk=2, num_experts=4)
PROMPT = [11, 12, 13]


def routes(rows: int) -> str:
    return encode_routed_experts(np.tile(np.array([[0, 1], [2, 3]], np.uint8), (rows, 1, 1)))


def body(finish="length", tokens=(5, 6), routed="auto", logprobs="auto", versions="auto"):
    content = [{"token_id": t, "logprob": -0.5 - i} for i, t in enumerate(tokens)] if logprobs == "auto" else logprobs
    return {"request_id": "generate-tokens-x", "choices": [{
        "index": 0, "finish_reason": finish, "token_ids": list(tokens),
        "routed_experts": routes(len(PROMPT) + len(tokens) - 1) if routed == "auto" else routed,
        "logprobs": {"content": content},
        "weight_versions": versions if versions != "auto" else [{"version": "default", "start": 0, "end": len(tokens)}],
    }]}


def parse(b, routes_spec=SPEC):
    return parse_response(b, url="http://e:1", index=3, group=1, request_id="rid-3", prompt=PROMPT, routes=routes_spec)


@pytest.mark.parametrize("finish,status", [("stop", SampleStatus.COMPLETED), ("length", SampleStatus.TRUNCATED),
                                           ("repetition", SampleStatus.COMPLETED)])
def test_finish_reason_sets_status_and_sample_fields(finish, status):
    s = parse(body(finish=finish, versions=[{"version": "4", "start": 0, "end": 2}]))
    assert s.status is status and s.finish_reason == finish
    assert s.response_ids.tolist() == [5, 6] and s.response_ids.dtype == np.int32
    np.testing.assert_allclose(s.rollout_logprobs, [-0.5, -1.5])
    assert s.loss_mask.tolist() == [1.0, 1.0]
    assert s.routed_experts.shape == (4, 2, 2) and s.routed_experts.dtype == np.uint8
    assert (s.index, s.group, s.request_id, s.weight_version) == (3, 1, "rid-3", 4)


def test_a_samples_repr_gives_sizes_not_contents():
    """asyncio.run reprs its finished task, the result included, when it restores SIGINT, so every rollout reprs its
    samples: a Sample's repr stays short at any length and still names the sample. Fails if Sample's own __repr__
    were dropped (the dataclass repr prints every token, log-prob and route: 20 ms per 128-sample CPU rollout)."""
    s = parse(body(tokens=tuple(range(5, 4005))))
    text = repr(s)
    assert len(text) < 400, text[:500]
    for part in ("index=3", "group=1", "request_id='rid-3'", "status=truncated", "prompt=3 tokens",
                 "response=4000 tokens", "routed_experts=(4002, 2, 2) uint8"):
        assert part in text, (part, text)


def test_unknown_finish_reason_is_an_engine_error():
    with pytest.raises(EngineError, match=r"sample 3 \(request rid-3\).*finish_reason='error'"):
        parse(body(finish="error"))


def test_aborted_before_any_token_has_no_routes_and_nothing_trainable():
    s = parse(body(finish="abort", tokens=(), routed=None))
    assert s.status is SampleStatus.ABORTED and s.routed_experts is None and s.response_length == 0


def test_aborted_mid_generation_keeps_its_routes_but_masks_everything():
    s = parse(body(finish="abort", tokens=(5, 6, 7)))
    assert s.status is SampleStatus.ABORTED and s.routed_experts.shape[0] == 5
    assert not s.loss_mask.any()


def test_missing_routes_on_a_finished_sample_fail_with_the_sample_named():
    with pytest.raises(RoutedExpertsError, match=r"sample 3 \(request rid-3\).*missing"):
        parse(body(routed=None))


def test_routes_ignored_without_routing_replay():
    s = parse(body(routed=None), routes_spec=None)
    assert s.routed_experts is None and s.status is SampleStatus.TRUNCATED


def test_logprobs_must_cover_every_response_token():
    with pytest.raises(EngineError, match="log-probs for 1 tokens, expected 2"):
        parse(body(logprobs=[{"token_id": 5, "logprob": -1.0}]))


@pytest.mark.parametrize("entry,what", [
    ({"token_id": 6}, "missing"),
    ({"token_id": 6, "logprob": None}, "null"),
    ({"token_id": 6, "logprob": float("nan")}, "nan"),
    ({"token_id": 6, "logprob": float("-inf")}, "-inf"),
    ({"token_id": 6, "logprob": "-0.5"}, "'-0.5' (str)"),
    (None, "missing"),
])
def test_a_logprob_that_is_not_a_finite_number_is_an_engine_error_naming_sample_and_token(entry, what):
    content = [{"token_id": 5, "logprob": -0.5}, entry]
    with pytest.raises(EngineError) as info:
        parse(body(logprobs=content))
    text = str(info.value)
    assert "sample 3 (request rid-3)" in text and "http://e:1" in text, text
    assert f"log-prob of response token 1 is {what}; expected a finite number" in text, text


def test_default_weight_version_is_none():
    assert parse(body(versions=[{"version": "default", "start": 0, "end": 2}])).weight_version is None


def test_the_oldest_labelled_version_is_the_samples():
    spans = [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 2}]
    assert parse(body(versions=spans)).weight_version == 4
    mixed = [{"version": "default", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 2}]
    assert parse(body(versions=mixed)).weight_version == 0


@pytest.mark.parametrize("versions, what", [
    (None, "weight_versions is None for 2 response tokens"),
    ([], "weight_versions is [] for 2 response tokens"),
    ([{"start": 0, "end": 2}], "expected the spans"),
    ([{"version": "run7-step3", "start": 0, "end": 2}], "labelled weight version 'run7-step3'"),
    ([{"version": "-1", "start": 0, "end": 2}], "labelled weight version '-1'"),
])
def test_a_missing_or_unparseable_weight_version_is_an_engine_error_naming_the_engine(versions, what):
    """Fails if a response without its version, or with a label r3rl never sent, is read as version 0 (the old
    behaviour): the sample's staleness, and with it the drop rule and the metrics, would be silently wrong."""
    with pytest.raises(EngineError) as info:
        parse(body(versions=versions))
    assert "http://e:1" in str(info.value) and what in str(info.value), str(info.value)


def test_an_empty_aborted_response_needs_no_version():
    assert parse(body(finish="abort", tokens=(), routed=None, versions=None), routes_spec=None).weight_version is None


def test_request_body_and_seeds():
    sampling = SamplingConfig(temperature=0.7, top_p=1.0, max_tokens=9, seed=100)
    b = request_body("r", [1, 2], sampling, seed=5, stop_token_ids=[7])
    sp = b["sampling_params"]
    assert b["token_ids"] == [1, 2] and b["request_id"] == "r"
    assert (sp["temperature"], sp["max_tokens"], sp["seed"], sp["stop_token_ids"], sp["logprobs"]) == \
        (0.7, 9, 5, [7], 0)
    assert request_body("r", [1], sampling, 5, max_tokens=3)["sampling_params"]["max_tokens"] == 3
    # min_tokens only when set, and never past a prompt's own cap (vLLM refuses min_tokens > max_tokens)
    assert "min_tokens" not in sp
    longer = dataclasses.replace(sampling, min_tokens=6)
    assert request_body("r", [1], longer, 5)["sampling_params"]["min_tokens"] == 6
    assert request_body("r", [1], longer, 5, max_tokens=3)["sampling_params"]["min_tokens"] == 3
    seeds = {sample_seed(100, step, i) for step in range(3) for i in range(64)}
    assert len(seeds) == 3 * 64 and sample_seed(100, 2, 5) == 100 + 2 * 100003 + 5
    # the LoRA adapter (trainer.lora.sync=adapter) is vLLM's model field, absent for the engine's own weights
    assert "model" not in b and request_body("r", [1], sampling, 5, adapter="r3rl-policy-v2")["model"] == \
        "r3rl-policy-v2"


def test_raw_body_that_is_not_a_json_object_is_an_engine_error():
    kwargs = dict(url="http://e:1", first_index=3, count=1, group=1, request_id="rid-3", prompt=PROMPT, routes=SPEC)
    for raw, what in ((b"<html>502 Bad Gateway</html>", "not JSON"), (b"[1, 2]", "a JSON list, expected an object")):
        with pytest.raises(EngineError, match=rf"sample 3 \(request rid-3\): response is {what}"):
            samples_from_body(raw, **kwargs)
    (s,) = samples_from_body(json.dumps(body()).encode(), **kwargs)
    assert s.routed_experts.shape == (4, 2, 2) and s.response_ids.tolist() == [5, 6]


def test_one_request_for_a_prompts_samples_maps_choice_j_to_sample_first_plus_j():
    """A request for n samples (vLLM's ``n``) answers n choices, maybe out of order. Fails if choice j stopped
    becoming sample first + j (samples swapped between seeds), if a missing or repeated choice index passed, or if
    request_body dropped ``n`` or sent it for one sample, or if the prefix-cache hits the engine reports
    (``usage.prompt_tokens_details.cached_tokens``, what r3rl.env.stitch.recomputed_rows needs) were not on every
    sample of the request."""
    sampling = SamplingConfig(max_tokens=9, seed=100)
    assert request_body("r", [1], sampling, 5, n=4)["sampling_params"]["n"] == 4
    assert "n" not in request_body("r", [1], sampling, 5)["sampling_params"]
    choices = []
    for j, tokens in enumerate([(5, 6), (7,), (8, 9, 10)]):
        one = body(tokens=tokens)["choices"][0]
        choices.append({**one, "index": j, "finish_reason": "abort" if j == 1 else "length"})
    kwargs = dict(url="http://e:1", first_index=8, count=3, group=1, request_id="rid-8x3", prompt=PROMPT, routes=SPEC)
    samples = parse_choices({"choices": choices[::-1]}, **kwargs)
    assert [s.index for s in samples] == [8, 9, 10]
    assert [s.response_ids.tolist() for s in samples] == [[5, 6], [7], [8, 9, 10]]
    assert [s.status for s in samples] == [SampleStatus.TRUNCATED, SampleStatus.ABORTED, SampleStatus.TRUNCATED]
    assert samples[2].routed_experts.shape == (len(PROMPT) + 3 - 1, 2, 2)
    assert [s.extra["cached_tokens"] for s in samples] == [None] * 3  # the engine did not say
    usage = {"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}
    assert [s.extra["cached_tokens"] for s in parse_choices({"choices": choices, **usage}, **kwargs)] == [2] * 3
    with pytest.raises(EngineError, match=r"samples 8-10 \(request rid-8x3\): expected exactly 3 choices .*got 2$"):
        parse_choices({"choices": choices[:2]}, **kwargs)
    with pytest.raises(EngineError, match=r"samples 8-10 .*got 3 with indices \[0, 1, 1\]"):
        parse_choices({"choices": [choices[0], choices[1], {**choices[2], "index": 1}]}, **kwargs)
    with pytest.raises(EngineError, match=r"sample 10 \(request rid-8x3\): log-probs for 0 tokens, expected 3"):
        parse_choices({"choices": [choices[0], choices[1], {**choices[2], "logprobs": None}]}, **kwargs)


def test_engines_whose_weights_another_update_labelled_are_named():
    """Fails if an attached engine that still serves another run's weights (labelled '37') were taken for one
    serving the checkpoint (vLLM's initial label): the run would train on another policy's samples."""
    from r3rl.rollout.wire import foreign_weight_labels

    labels = {"http://a:1": "default", "http://b:2": "37", "http://c:3": None}
    assert foreign_weight_labels(labels) == {"http://b:2": "37", "http://c:3": None}


def test_request_body_carries_the_cache_salt_only_when_given():
    """Fails if a salted request loses its salt (a request after an in-flight weight update would then reuse prefix
    blocks computed by older weights) or an unsalted one gets one (every request would miss the prefix cache)."""
    from r3rl.config.schema import SamplingConfig
    from r3rl.rollout.wire import request_body

    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=4, seed=1)
    assert "cache_salt" not in request_body("r", [1, 2], sampling, 0)
    assert request_body("r", [1, 2], sampling, 0, cache_salt="r3rl-weights-3")["cache_salt"] == "r3rl-weights-3"
