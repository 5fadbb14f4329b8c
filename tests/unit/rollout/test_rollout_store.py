"""Rollout files and ``python -m r3rl.tools.verify_rollout``: exact round trip, and every contract breach reported
with the sample and request named (non-zero exit)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from r3rl.rollout.store import load_rollout, save_rollout
from r3rl.rollout.verify import verify_samples
from r3rl.sample import Sample, SampleStatus
from r3rl.tools import verify_rollout

L, K, E = 3, 2, 8


def make_sample(i: int, p: int = 4, r: int = 3, status=SampleStatus.TRUNCATED, routes=True) -> Sample:
    rng = np.random.default_rng(i)
    t = p + r
    routed = np.argsort(rng.random((t - 1, L, E)), axis=-1)[..., :K].astype(np.uint8) if routes else None
    finish = {SampleStatus.TRUNCATED: "length", SampleStatus.COMPLETED: "stop", SampleStatus.ABORTED: "abort"}[status]
    return Sample(index=i, group=i // 2, request_id=f"rid-{i}", prompt_ids=rng.integers(0, 100, p).astype(np.int32),
                  response_ids=rng.integers(0, 100, r).astype(np.int32),
                  rollout_logprobs=-rng.random(r).astype(np.float32),
                  loss_mask=np.full(r, 0.0 if status is SampleStatus.ABORTED else 1.0, np.float32),
                  finish_reason=finish, status=status, routed_experts=routed, label=str(i), reward=0.5,
                  weight_version=2, extra={"engine": "http://e:1"})


def batch() -> list[Sample]:
    return [make_sample(0), make_sample(1, p=6, r=1, status=SampleStatus.COMPLETED),
            make_sample(2, r=0, status=SampleStatus.ABORTED, routes=False), make_sample(3, p=2, r=5)]


def test_round_trip_is_exact(tmp_path):
    samples = batch()
    path = save_rollout(samples, tmp_path / "step_000001")
    assert path.name == "step_000001.npz"
    back = load_rollout(path)
    assert len(back) == len(samples)
    for a, b in zip(samples, back):
        for f in dataclasses.fields(Sample):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype
                np.testing.assert_array_equal(x, y)
            else:
                assert x == y, f.name
    assert back[2].routed_experts is None and back[0].routed_experts.dtype == np.uint8


def run_cli(path, *extra) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "r3rl.tools.verify_rollout", str(path), "--num-layers", str(L),
                          "--topk", str(K), "--num-experts", str(E), *extra], capture_output=True, text=True,
                         timeout=120)
    return out.returncode, out.stdout + out.stderr


def test_cli_accepts_a_good_rollout_folder(tmp_path):
    save_rollout(batch(), tmp_path / "step_000001.npz")
    save_rollout(batch()[:2], tmp_path / "step_000002.npz")
    code, text = run_cli(tmp_path)
    assert code == 0, text
    assert "6 samples in 2 file(s)" in text


def breach(kind: str) -> tuple[list[Sample], str]:
    s = batch()
    bad = s[3]
    if kind == "rows":
        bad.routed_experts = bad.routed_experts[:-1]
        return s, "rows: expected 6 (len(tokens) - 1), got 5"
    if kind == "wide":
        bad.routed_experts = bad.routed_experts.astype(np.int64)
        return s, "expected uint8"
    if kind == "duplicate":
        bad.routed_experts = bad.routed_experts.copy()
        bad.routed_experts[2, 1] = [4, 4]
        return s, "[4, 4] at token row 2, layer 1"
    if kind == "range":
        bad.routed_experts = bad.routed_experts.copy()
        bad.routed_experts[0, 0, 0] = E
        return s, "ids < num_experts = 8"
    if kind == "layers":
        bad.routed_experts = np.concatenate([bad.routed_experts, bad.routed_experts[:, :1]], axis=1)
        return s, "expected (3, 2), got (4, 2)"
    if kind == "missing":
        bad.routed_experts = None
        return s, "routed experts missing"
    if kind == "aborted_trained":
        s[2] = make_sample(2, r=2, status=SampleStatus.ABORTED)
        s[2].loss_mask[:] = 1.0
        return s, "aborted sample would be trained on"
    if kind == "status":
        bad.finish_reason = "abort"
        return s, "does not match finish_reason"
    if kind == "logprobs":
        bad.rollout_logprobs = bad.rollout_logprobs[:-1]
        return s, "rollout_logprobs has the wrong length: expected 5"
    raise AssertionError(kind)


KINDS = ["rows", "wide", "duplicate", "range", "layers", "missing", "aborted_trained", "status", "logprobs"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_breach_is_reported_with_sample_and_request(kind):
    samples, message = breach(kind)
    problems = verify_samples(samples, num_layers=L, topk=K, num_experts=E)
    assert len(problems) == 1 and message in problems[0], problems
    who = 2 if kind == "aborted_trained" else 3
    assert f"sample {who} (request rid-{who})" in problems[0]


def test_cli_fails_with_the_reason(tmp_path, capsys):
    samples, message = breach("duplicate")
    save_rollout(samples, tmp_path / "bad.npz")
    assert verify_rollout.main([str(tmp_path / "bad.npz"), "--num-layers", str(L), "--topk", str(K)]) == 1
    err = capsys.readouterr().err
    assert message in err and "rid-3" in err and "FAILED: 1 problems in 4 samples" in err


def test_cli_on_missing_or_foreign_files(tmp_path):
    assert verify_rollout.main([str(tmp_path), "--num-layers", "3", "--topk", "2"]) == 2
    np.savez(tmp_path / "other.npz", meta=np.frombuffer(b'{"format": "x"}', np.uint8))
    assert verify_rollout.main([str(tmp_path / "other.npz"), "--num-layers", "3", "--topk", "2"]) == 2
