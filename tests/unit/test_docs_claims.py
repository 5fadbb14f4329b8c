"""What the pages tell a user to type exists: every ``python run.py`` / ``python doctor.py`` command line composes (its
keys, groups and options, and a prompt file under the preset it means), every config key and group option a page
names in code is the config's, every flag of a script or module is one it takes, and every generated figure block
is still written by the script it names."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from r3rl.config import CONF_DIR, ConfigError, hydra_error, register_configs
from r3rl.config.intent import named_file_problems, with_named_files
from r3rl.config.schema import R3RLConfig
from r3rl.config.validate import schema_keys, unknown_keys

REPO = CONF_DIR.parent
PAGES = sorted([REPO / "README.md", REPO / "slurm" / "README.md", *(REPO / "docs").rglob("*.md")])
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
TOP = {k for k in schema_keys() if "." not in k}
# keys whose children are the user's own (named eval sets, Megatron's TransformerConfig, an environment's arguments)
OPEN_KEYS = ("eval.sets.", "trainer.transformer_overrides.", "env.environment.")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".sh", ".sub", ".png", ".html", ".parquet", ".txt",
                 ".toml", ".safetensors", ".env")
PLACEHOLDER = "/tmp/r3rl-docs-placeholder"


def code_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of every shell line in a fenced block (continuations joined) and every inline code span."""
    found, fence, held, start = [], False, "", 0
    for n, line in enumerate(page.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            text = line.split(" # ")[0].rstrip() if not line.lstrip().startswith("#") else ""
            if held:
                held += " " + text.strip()
            else:
                held, start = text, n
            if held.endswith("\\"):
                held = held[:-1]
                continue
            if held.strip():
                found.append((start, held.strip()))
            held = ""
        else:
            found += [(n, span) for span in re.findall(r"`([^`]+)`", line)]
    return found


def commands(tool: str) -> list[tuple[str, str]]:
    """(``page:line``, command) of every ``python <tool>`` command line the pages show."""
    out = []
    for page in PAGES:
        for n, text in code_lines(page):
            for cmd in re.findall(rf"python {re.escape(tool)}(?: [^`;|&]*)?", text):
                out.append((f"{page.relative_to(REPO)}:{n}", cmd))
    return out


def overrides_of(cmd: str) -> list[str] | None:
    """The Hydra overrides of a command line, placeholders (``...``, ``<x>``, ``$VAR``) made a path; None for a line
    that is no launch (``--trace``, a usage line)."""
    try:
        words = shlex.split(cmd)[2:]
    except ValueError:
        return None
    if "--trace" in words or any(w in ("[overrides]", "ARGS") for w in words):
        return None
    sweep = "-m" in words
    out = []
    for word in words:
        if word.startswith("-") or "=" not in word:
            continue
        key, value = word.split("=", 1)
        if not value or value.startswith("...") or re.search(r"[<>$]|\.\.\.|/path/to|^DIR$|^RUN$", value):
            if key.lstrip("+~") in GROUPS:  # "any option of the group": nothing to check
                continue
            value = PLACEHOLDER
        elif sweep and "," in value and not value.startswith("["):
            value = value.split(",")[0]
        out.append(f"{key}={value}")
    return out


def compose_raw(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return compose("config", overrides=overrides)


LAUNCHES = commands("run.py") + commands("doctor.py")


def test_the_pages_show_launch_commands():
    """Fails if the extraction found none (the checks below would pass on nothing)."""
    assert len(LAUNCHES) > 30 and any("README.md" in where for where, _ in LAUNCHES)


@pytest.mark.parametrize("where, cmd", LAUNCHES, ids=[w for w, _ in LAUNCHES])
def test_every_documented_launch_composes(where, cmd):
    """Fails when a page's command names a key, group or option the config lacks, a value of the wrong type, or a
    prompt file under the default arithmetic preset (it would train with the generated task's grader). The README's
    GPU command once did the last."""
    from hydra.errors import HydraException

    overrides = overrides_of(cmd)
    if overrides is None:
        pytest.skip("not a launch")
    overrides = with_named_files(overrides)
    try:
        raw = compose_raw(overrides)
    except HydraException as err:
        pytest.fail(f"{where}: `{cmd}`: {hydra_error(err)}")
    problems = [(k, "not a key of the config") for k in unknown_keys(raw, R3RLConfig)]
    problems += named_file_problems(raw, overrides)
    assert problems == [], f"{where}: `{cmd}`: {ConfigError(problems)}"
    OmegaConf.to_object(raw)  # every value of its type


def named_keys() -> list[tuple[str, str]]:
    """(``page:line``, key) of every config key a page names in code (``data.path``, ``run.num_steps=10``)."""
    out = []
    for page in PAGES:
        for n, text in code_lines(page):
            for token in re.split(r"[\s(),]+", text):
                key = token.split("=", 1)[0].lstrip("+~")
                if re.fullmatch(r"[a-z_]+(\.[a-z0-9_]+)+", key) and key.split(".")[0] in TOP \
                        and not key.endswith(FILE_SUFFIXES) and f"{key}(" not in text:  # a method call
                    out.append((f"{page.relative_to(REPO)}:{n}", key))
    return out


def test_every_config_key_a_page_names_is_a_key():
    """Fails when a page names a config key the schema does not have (a renamed or removed key left in the prose),
    e.g. `run.num_step`."""
    keys = set(schema_keys())
    found = named_keys()
    assert len(found) > 100
    wrong = sorted({f"{where}: {key}" for where, key in found if key not in keys and not key.startswith(OPEN_KEYS)})
    assert wrong == []


def test_every_group_option_a_page_names_exists():
    """Fails when a page names ``group=option`` for an option with no ``conf/<group>/<option>.yaml``."""
    wrong, seen = [], 0
    for page in PAGES:
        for n, text in code_lines(page):
            for group, option in re.findall(r"(?<![\w.+~-])([a-z_]+)=([A-Za-z0-9_,]+)(?![\w./=-])", text):
                if group not in GROUPS or group == "hydra":
                    continue
                seen += 1
                for name in option.split(","):
                    if not (CONF_DIR / group / f"{name}.yaml").is_file():
                        wrong.append(f"{page.relative_to(REPO)}:{n}: {group}={name}")
    assert seen > 50 and wrong == []


def script_source(word: str) -> str | None:
    """The text of what a command runs: ``bench/x.py``, ``scripts/x.sh``, ``-m r3rl.pkg`` (its package's files)."""
    path = REPO / word
    if word.endswith((".py", ".sh", ".sub")) and path.is_file():
        return path.read_text()
    if word.startswith("r3rl."):
        module = REPO / "src" / Path(*word.split("."))
        files = list(module.glob("*.py")) if module.is_dir() else [module.with_suffix(".py")]
        return "\n".join(f.read_text() for f in files if f.is_file()) or None
    return None


def test_every_flag_a_page_passes_a_script_is_one_it_takes():
    """Fails when a page passes a script or module a flag it does not define, on its command line or as a bare
    ```--flag``` after it on the same line (``scripts/gpu_check.sh --download ...; `--plan-only` prints ...`` was
    documented; the flag is bench/gpu_memory_probe.py's)."""
    wrong, seen = [], 0
    command = re.compile(r"(?:python (?:-m )?)?([\w./-]+\.(?:py|sh|sub)|(?<=-m )r3rl[\w.]*)")
    for page in PAGES:
        last = {}  # line -> the script or module a bare flag on that line belongs to
        for n, text in code_lines(page):
            targets = [t for t in command.findall(text) if script_source(t) is not None]
            if targets:
                last[n] = targets[-1]
            target = targets[-1] if targets else (last.get(n) if re.fullmatch(r"--[a-z][\w-]*", text) else None)
            if target is None:
                continue
            source = script_source(target)
            after = text.split(target, 1)[1] if target in text else text
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", after):
                seen += 1
                if flag not in source:
                    wrong.append(f"{page.relative_to(REPO)}:{n}: {target} {flag}")
    assert seen > 10 and wrong == []


def test_every_generated_block_is_still_written_by_its_script():
    """A figure block names the script that writes it; fails when that script is gone or no longer writes that
    block (its figures would then be hand-kept), or a block is opened and not closed."""
    blocks = 0
    for page in PAGES:
        text = page.read_text()
        for name, script in re.findall(r"<!-- (\w+):begin \(written by (\S+) --write-docs; do not edit\) -->", text):
            blocks += 1
            source = (REPO / script).read_text() if (REPO / script).is_file() else ""
            assert f"<!-- {name}:begin (written by {script} --write-docs; do not edit) -->" in source, \
                f"{page.relative_to(REPO)}: block {name} is not written by {script}"
            assert text.count(f"<!-- {name}:end -->") == text.count(f"<!-- {name}:begin"), (page, name)
    assert blocks >= 8


QUOTE_BEGIN = re.compile(r"<!-- (\w+):begin \(quoted by bench/quote\.py from (\S+); do not edit\) -->")
RECORD_BEGIN = re.compile(r"<!-- (\w+):begin \(record: measured by (\S+) up to commit ([0-9a-f]{7,40}), not rerun\) -->")
ESTIMATE_BEGIN = re.compile(r"<!-- (\w+):begin \(arithmetic on paper, not a measurement\) -->")
# what a measured figure looks like in prose: a value with its error, standard errors, a ratio, a percentage, a
# duration, a rate, or a small decimal; `key=value` (a setting) and generated pages are not figures
FIGURE = re.compile(r"\d\s*(±|\+-)\s*\d|\b\d+\.\d+\s*(se|standard errors)\b|\b\d+\.\d+x\b|\b\d+(\.\d+)?\s*%"
                    r"|\b\d+(\.\d+)?\s*(min|minutes|ms|seconds)\b|\b\d+\.\d+\s*s\b|(~|about )\d+(\.\d+)?\s*s\b"
                    r"|\b\d+(\.\d+)?\s*(tokens/s|GB/s)|\b0\.\d{3,}\b|\b\d\.\d+e-\d+\b")
# not figures: a setting (`key=value`), a bound the code holds to ("within 8 minutes", "at most 5%"), a code span
# without a space (a literal input such as `1.5e-99999999`)
NOT_FIGURES = re.compile(r"[\w.]+=\S+|\b(within|at most) ~?[\d.,]+\s*\S*|`[^` ]+`")
GENERATED_PAGES = ("docs/reference/",)


def figures_outside_blocks(page: Path) -> list[str]:
    """``page:line: text`` of every line that quotes a measured figure outside a block a script writes, a record
    naming its script and commit, or a block of arithmetic."""
    found, inside = [], None
    for n, line in enumerate(page.read_text().splitlines(), start=1):
        opened = re.search(r"<!-- (\w+):begin", line)
        if opened and inside is None:
            inside = opened.group(1)
            continue
        if inside is not None:
            if f"<!-- {inside}:end -->" in line:
                inside = None
            continue
        if FIGURE.search(NOT_FIGURES.sub("", line)):
            found.append(f"{page.relative_to(REPO)}:{n}: {line.strip()[:120]}")
    return found


WRITTEN_BEGIN = re.compile(r"<!-- (\w+):begin \(written by (\S+) --write-docs; do not edit\) -->")
KNOWN_BEGINS = (WRITTEN_BEGIN, QUOTE_BEGIN, RECORD_BEGIN, ESTIMATE_BEGIN)


def prose_pages() -> list[Path]:
    return [p for p in PAGES if not str(p.relative_to(REPO)).startswith(GENERATED_PAGES)]


def test_no_page_types_a_figure_by_hand():
    """Every measured figure a page quotes stands in a block a script writes (``--write-docs`` or bench/quote.py), a
    record naming the script and commit it was measured by, or a block of paper arithmetic; fails on a figure typed
    into prose (as the default run's 0.000122 / 4.3 se / 0.90 stood on three pages before this test)."""
    found = [hit for page in prose_pages() for hit in figures_outside_blocks(page)]
    assert found == [], "figures outside a generated block or a record:\n" + "\n".join(found)


def test_the_figure_scan_sees_typed_figures(tmp_path):
    """The scan itself: figures in prose are found, the same inside a block, a setting or a bound are not; fails
    when FIGURE or the block handling stops telling them apart."""
    page = REPO / "docs" / "__scan_probe__.md"
    typed = ["replay removes 0.000227 ± 0.000041 per sample", "a ratio of 0.81x", "flip rate 0.61%",
             "it took 4.0 min", "5.5 se", "1615 tokens/s", "sync 1.88 s", "|dlogp| 1.39e-03"]
    kept = ["`trainer.lr=0.0005` and `correction.seq_ratio_low=0.999`", "finishes within 8 minutes",
            "a literal `1.5e-99999999`", "3 standard errors of the mean", "48 layers, 128 experts, top-8"]
    block = ["<!-- probe:begin (record: measured by bench/quote.py up to commit abcdef0, not rerun) -->",
             "a ratio of 0.81x inside a record", "<!-- probe:end -->"]
    try:
        page.write_text("\n".join([*typed, *kept, *block]) + "\n")
        hits = figures_outside_blocks(page)
    finally:
        page.unlink()
    assert [h.split(": ", 1)[1] for h in hits] == typed


def test_every_block_is_of_a_known_kind():
    """A block hides its lines from the figure scan, so only the four kinds may open one; fails on a block of another
    form (which would let a hand-typed figure through as 'generated')."""
    wrong = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), start=1):
            if re.search(r"<!-- \w+:begin", line) and not any(b.search(line) for b in KNOWN_BEGINS):
                wrong.append(f"{page.relative_to(REPO)}:{n}: {line.strip()}")
    assert wrong == []


def git_has_commit(commit: str) -> bool | None:
    """Whether this clone holds the commit; None where there is no git history to ask (an exported tree)."""
    import subprocess

    if not (REPO / ".git").exists():
        return None
    done = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True)
    return done.returncode == 0


def test_every_record_names_a_script_and_a_commit_of_this_repository():
    """A record's figures are as measured by the script it names at the commit it names; fails when the script is
    gone or the commit is not in this repository's history (a record made up, or pointing at a rewritten branch)."""
    records = 0
    for page in prose_pages():
        for name, script, commit in RECORD_BEGIN.findall(page.read_text()):
            records += 1
            assert (REPO / script).exists(), f"{page.relative_to(REPO)}: record {name} names {script}, which is gone"
            assert git_has_commit(commit) is not False, f"{page.relative_to(REPO)}: record {name}: no commit {commit}"
    assert records >= 10


def test_every_quote_holds_its_script_s_figure_line():
    """A block quoted by bench/quote.py holds the command, machine and date and the script's last line, and that
    line's words are still what the script prints; fails on an empty block (never run) or a script whose figure line
    changed since (rerun it)."""
    quotes = 0
    for page in prose_pages():
        text = page.read_text()
        for name, script in QUOTE_BEGIN.findall(text):
            quotes += 1
            body = text.split(f"<!-- {name}:begin", 1)[1].split(f"<!-- {name}:end -->", 1)[0]
            where = f"{page.relative_to(REPO)}: quote {name}"
            assert (REPO / script).is_file(), f"{where}: {script} is gone"
            assert f"`python {script}" in body and re.search(r", \d{4}-\d{2}-\d{2}\)", body), \
                f"{where}: empty or without its command and date; run python bench/quote.py {script}"
            last = [line for line in body.strip().splitlines() if line.strip() and line.strip() != "```"][-1]
            last = re.findall(r"`([^`]+)`", last)[-1] if last.endswith("`") else last
            words = re.split(r"(?<=[\s:(])[-+~]?\d", last)[0].strip()
            assert len(words) >= 6 and words in (REPO / script).read_text(), \
                f"{where}: {script} no longer prints {words!r}"
    assert quotes >= 8
