"""A refused config says what to do: one exit status, the near key of a misspelt one, the value a rule got, a bad
key reported once (not again through the keys computed from it), and the fix that works first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from r3rl.config import ConfigError, compose as compose_config
from r3rl.preflight import compose

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("override, said", [
    ("run.num_step=10", "run.num_step: not a key of the config (did you mean run.num_steps?)"),
    ("+run.num_step=10", "run.num_step: not a key of the config (did you mean run.num_steps?)"),
    ("model=qwen3_3b", "model=qwen3_3b: no such option (did you mean qwen3_30b?)"),
    ("run.num_steps=abc", "run.num_steps: Value 'abc' of type 'str' could not be converted to Integer"),
])
def test_a_misspelt_key_or_option_exits_2_with_the_near_one(override, said):
    """docs/troubleshooting.md promises exit 2 for a refused config; Hydra's own refusal exited 1 and its "use
    +run.num_step=..." hint led into r3rl's "not a key" refusal. Fails if run.py lets Hydra's app report the typo
    (exit 1), or the message lacks the near key or option."""
    out = subprocess.run([sys.executable, "run.py", "run.dry_run=true", override], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert said in " ".join(out.stderr.split()) and "To append to your config" not in out.stderr


def test_a_bad_key_is_reported_alone_with_the_value_it_got():
    """``algorithm.rollout_batch_size=-4`` also blamed global_batch_size (its samples per step were -16), and
    several "must be >= 1" rules printed no value. Fails if a rule computed from an invalid key reports it again, or
    a "must be" reason lacks what it got."""
    for override, key, got in (("algorithm.rollout_batch_size=-4", "algorithm.rollout_batch_size", "got -4"),
                               ("rollout.sampling.max_tokens=0", "rollout.sampling.max_tokens", "got 0"),
                               ("trainer.micro_batch_size=0", "trainer.micro_batch_size", "got 0"),
                               ("run.num_steps=0", "run.num_steps", "got 0")):
        with pytest.raises(ConfigError) as err:
            compose_config(["parallelism=cpu", override])
        assert [k for k, _ in err.value.problems] == [key], err.value.problems
        assert got in err.value.problems[0][1]


def test_the_in_flight_kv_refusal_leads_with_the_max_num_seqs_that_fits():
    """When the KV cache cannot hold the in-flight sequences, raising the memory share is no fix where no share of a
    GPU can cover it. Fails if the refusal does not lead with a rollout.engine.max_num_seqs that fits (31 sequences
    of 144 tokens, two blocks of 128 each, in the 63 blocks of 8 MiB with vLLM's null block aside), or that value
    would not pass, or one more would."""
    in_flight = ["parallelism=cpu", "algorithm.max_staleness=1", "correction=tis", "algorithm.weight_update=in_flight",
                 "rollout.engine.kv_cache_memory_bytes=8388608"]
    with pytest.raises(ConfigError) as err:
        compose(in_flight)
    (key, reason), = err.value.problems
    fix = reason.split("; ", 1)[1]
    assert fix.startswith("set rollout.engine.max_num_seqs=31 "), reason
    compose([*in_flight, "rollout.engine.max_num_seqs=31"])
    with pytest.raises(ConfigError, match="64 blocks in all, where the cache holds 63"):
        compose([*in_flight, "rollout.engine.max_num_seqs=32"])
