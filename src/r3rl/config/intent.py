"""What a file named on the command line means: the user's own data or model, never replaced by generated ones.

The presets that make the CPU run work out of the box (``data=arithmetic``, ``model=tiny_moe``, the CPU scale's warm
start) generate what is missing. A user who names a file of their own (``data.path=``, ``model.checkpoint=``,
``eval.sets.<name>.path=``) means that file: a missing or mistyped one must be refused, not filled with random
weights or arithmetic prompts, and their checkpoint is not warm-started again. So a named file turns its
generation off (and a named checkpoint the warm start) unless the same command line sets that key too; the
override is added to the command line itself, so Hydra's saved config and every process see the same settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

# key a user names -> the keys that generate in its place, turned off unless named as well
GENERATED_BY = {
    "data.path": ("data.generate_if_missing",),
    "model.checkpoint": ("model.generate_if_missing", "warm_start.enabled"),
}
# the data presets a prompt file of the user's own cannot mean without saying so: the generated task's grader
# (boxed_exact) and prompt length (256 tokens) would apply to it
GENERATED_PRESETS = ("arithmetic",)
USER_PRESETS = "data=dapo_math, data=gsm8k or data=math"


def override_key(override: str) -> str:
    """``data.path`` of ``data.path=x``, ``+data.path=x``, ``~data.path``; the group of ``data=gsm8k``."""
    return override.split("=", 1)[0].lstrip("~+")


def _eval_path_key(key: str) -> str | None:
    parts = key.split(".")
    if len(parts) == 4 and parts[0] == "eval" and parts[1] == "sets" and parts[3] == "path":
        return f"eval.sets.{parts[2]}.generate_if_missing"
    return None


def with_named_files(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with ``<key>=false`` added for each generation a named file turns off (idempotent)."""
    named = {override_key(o) for o in overrides if not o.startswith("-")}
    added = []
    for key in sorted(named):
        turned_off = GENERATED_BY.get(key, ()) or ((_eval_path_key(key),) if _eval_path_key(key) else ())
        added += [f"{off}=false" for off in turned_off if off not in named and f"{off}=false" not in added]
    return [*overrides, *added]


def named_file_problems(raw: DictConfig, overrides: Sequence[str]) -> list[tuple[str, str]]:
    """A prompt file named under a data preset made for generated prompts, which nobody chose (``data=`` neither on
    the command line nor in an experiment): its grader and prompt length are the generated task's, not the file's."""
    named = {override_key(o) for o in overrides}
    data = raw.get("data")
    if "data.path" not in named or "data" in named or data is None or data.get("name") not in GENERATED_PRESETS:
        return []
    return [("data.path", f"names a prompt file of your own ({data.get('path')}), but the data preset is the default "
                          f"data={data.get('name')}, the generated task's (reward={raw.reward.name}, prompts over "
                          f"{data.get('max_prompt_length')} tokens dropped): name the preset of your file, "
                          f"{USER_PRESETS} (graded by math-verify), or data={data.get('name')} for arithmetic "
                          "prompts of your own")]
