"""The documentation's links hold: every relative link in README.md and docs/*.md names a file of the repository
and, after a #, a heading of that file (as GitHub makes anchors of headings). The README is a front door to docs/,
so a section moved or renamed there must not leave a link pointing at nothing."""

import re
from pathlib import Path

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # the user docs
DEV_DOCS = sorted((REPO / "docs" / "dev").glob("*.md"))  # how the project is built and measured: docs/dev/
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a file's headings: lower case, punctuation dropped, spaces to hyphens, a repeated
    heading numbered -1, -2..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this repository's
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("path", DOCS + DEV_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_an_existing_file_and_heading(path):
    assert broken_links(path) == [], f"{path.relative_to(REPO)}: broken links"


def test_a_link_to_a_missing_file_or_heading_is_found(tmp_path):
    (tmp_path / "OTHER.md").write_text("# Other\n\n## A section, renamed\n\n```\n# not a heading\n```\n")
    doc = tmp_path / "DOC.md"
    doc.write_text("[ok](OTHER.md#a-section-renamed) [here](#doc) [web](https://example.com/x.md)\n\n# Doc\n\n"
                   "[gone](MISSING.md) [moved](OTHER.md#a-section) [fenced](OTHER.md#not-a-heading)\n"
                   "```\n[in code](NOWHERE.md)\n```\n")
    assert broken_links(doc) == [f"MISSING.md: no file {tmp_path / 'MISSING.md'}",
                                 "OTHER.md#a-section: no heading #a-section in OTHER.md",
                                 "OTHER.md#not-a-heading: no heading #not-a-heading in OTHER.md"]


def test_the_readme_maps_every_file_of_docs():
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in DOCS[1:] if f"](docs/{p.name})" not in readme] == []


TEST_REF = re.compile(r"(?:(\w+\.py)|…)::(test_\w+)")


def missing_tests(markdown: str, tests_dir: Path) -> list[str]:
    """The tests a document names that no test file defines: as `file.py::test_name`, a test of that file; as
    `…::test_name` (the file said by the text around it), a test of any file. A test renamed or removed leaves the
    document pointing at nothing."""
    defined = {f.name: set(re.findall(r"^def (test_\w+)\(", f.read_text(), re.M)) for f in tests_dir.glob("*.py")}
    anywhere = set().union(*defined.values())
    return [f"{file or '…'}::{name}" for file, name in TEST_REF.findall(markdown)
            if name not in (defined.get(file, set()) if file else anywhere)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_document_names_exists(path):
    assert missing_tests(path.read_text(), REPO / "tests") == [], f"{path.relative_to(REPO)}: tests not found"


def test_a_renamed_test_is_found(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_kept():\n    pass\n")
    (tmp_path / "test_y.py").write_text("def test_other():\n    pass\n")
    doc = ("`test_x.py::test_kept`, `…::test_other`, `…::test_renamed`; `tests/test_x.py::test_kept`; "
           "`test_gone.py::test_kept`; `test_x.py::test_other`")
    assert missing_tests(doc, tmp_path) == ["…::test_renamed", "test_gone.py::test_kept", "test_x.py::test_other"]


# --- every name a document gives exists: config keys, `raysft` flags, module paths -------------------------------

FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
# Dotted names that look like a config key and are not one: files (`model.safetensors`, `metrics.jsonl`), tensor
# names (`model.layers.0.mlp.up_proj.weight`), a method, and the run identity's weight fingerprint in raysft_run.json.
NOT_KEYS = {"model.layers", "model.norm", "model.model", "model.generate", "model.init", "model.weights"}
FILE_SUFFIX = re.compile(r"\.(?:json|jsonl|safetensors|py|yaml|md|parquet|png|jinja|txt)\b")


def config_keys() -> set[str]:
    from raysft.config import reference_markdown
    return set(re.findall(r"^\| `([^`]+)` \|", reference_markdown(), re.M))


def unknown_keys(markdown: str, keys: set[str]) -> list[str]:
    """The `section.key` names a document gives that the configuration does not have (the sections are those of
    the configuration reference; a nested key such as `model.lora.r` is checked to its last part)."""
    sections = sorted({k.split(".")[0] for k in keys})
    pattern = re.compile(rf"(?<![\w./\-])(?:{'|'.join(sections)})(?:\.[a-z_][a-z0-9_]*)+(?![\w/(-])")
    unknown = []
    for m in pattern.finditer(markdown):
        name = m.group(0)
        not_a_key = FILE_SUFFIX.search(name) or FILE_SUFFIX.match(markdown, m.end())
        if not_a_key or ".".join(name.split(".")[:2]) in NOT_KEYS:
            continue
        parts = name.split(".")
        # the longest prefix that is a key, or a section of keys (`model.lora` holds `model.lora.r`)
        if not any(".".join(parts[:i]) in keys for i in range(2, len(parts) + 1)) and \
                not any(k.startswith(name + ".") for k in keys):
            unknown.append(name)
    return unknown


def cli_flags() -> dict[str, set[str]]:
    import argparse

    from raysft.cli import build_parser
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in subparsers.choices.items()}


def code_lines(markdown: str) -> list[str]:
    """Every line of the fenced blocks (a `\\` continuation joined to its line) and every inline code span."""
    lines = [line for block in FENCED.findall(markdown) for line in block.replace("\\\n", " ").splitlines()]
    return lines + SPAN.findall(FENCED.sub("", markdown))


RAYSFT_CMD = re.compile(r"(?:^\s*(?:\$ )?|[;&|(]\s*|\s)(?:\S*/)?(?:raysft|python3? -m raysft)\s+([a-z]+)(?=\s|$)(.*)")
BENCH_CMD = re.compile(r"(?:python3?|\.venv/bin/python)\s+(bench/[\w/]+\.py)(.*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def unknown_flags(markdown: str, flags: dict[str, set[str]], repo: Path) -> list[str]:
    """The flags a document's commands pass that the command does not take: `raysft SUB --flag` against the
    argparse parser of SUB (raysft/cli.py), `python bench/X.py --flag` against the script's source (and
    bench/common.py's, which holds the shared ones)."""
    unknown = []
    for line in code_lines(markdown):
        line = line.split(" #")[0]
        m = RAYSFT_CMD.search(line)
        if m and m.group(1) in flags:
            unknown += [f"raysft {m.group(1)} {f}" for f in FLAG.findall(m.group(2)) if f not in flags[m.group(1)]]
        elif m and re.match(r"\s*(?:\$ )?raysft ", line):
            unknown.append(f"raysft {m.group(1)}: no such command")
        for m in BENCH_CMD.finditer(line):
            script = repo / m.group(1)
            if not script.is_file():
                unknown.append(f"{m.group(1)}: no such script")
                continue
            source = script.read_text() + (repo / "bench" / "common.py").read_text()
            unknown += [f"{m.group(1)} {f}" for f in FLAG.findall(m.group(2))
                        if f'"{f}"' not in source and f"'{f}'" not in source]
    return unknown


def module_exists(repo: Path, parts: list[str]) -> Path | None:
    base = repo.joinpath("raysft", *parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def missing_modules(markdown: str, repo: Path, relative: bool = False) -> list[str]:
    """The module paths a document names that the tree does not hold: `raysft/x/y.py` (or any file or directory
    under raysft/), `raysft.x.y` (a module, or a module and one name it defines); with `relative` also `x/y` and
    `x/y.py` for x a package of raysft (ARCHITECTURE.md names modules so)."""
    missing = []
    for m in re.finditer(r"(?<![\w./\-])raysft/([\w./\-]*\w)?", markdown):
        path = repo / "raysft" / (m.group(1) or "")
        if not (path.exists() or path.with_suffix(".py").exists()):
            missing.append(m.group(0))
    for m in re.finditer(r"(?<![\w./\-])raysft((?:\.\w+)+)", markdown):
        parts = m.group(1)[1:].split(".")
        if FILE_SUFFIX.fullmatch("." + parts[-1]):
            continue
        found = next((i for i in range(len(parts), -1, -1) if module_exists(repo, parts[:i])), None)
        rest = parts[found:] if found is not None else parts
        if found is None or len(rest) > 1 or (rest and not re.search(
                rf"\b{rest[0]}\b", module_exists(repo, parts[:found]).read_text())):
            missing.append(m.group(0))
    if relative:
        packages = sorted(p.name for p in (repo / "raysft").iterdir() if (p / "__init__.py").is_file())
        pattern = rf"(?<![\w./\-])(?:{'|'.join(packages)})/(\w+)(?:\.py\b|(?![\w/.]|\.\w))"
        for m in re.finditer(pattern, markdown):
            package = m.group(0).split("/")[0]
            if not module_exists(repo, [package, m.group(1)]):
                missing.append(m.group(0))
    return missing


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_key_flag_and_module_a_document_names_exists(path):
    markdown = path.read_text()
    found = {"keys the configuration lacks": unknown_keys(markdown, config_keys()),
             "flags the commands lack": unknown_flags(markdown, cli_flags(), REPO),
             "module paths the tree lacks": missing_modules(markdown, REPO, relative=path.name == "ARCHITECTURE.md")}
    assert {what: names for what, names in found.items() if names} == {}, str(path.relative_to(REPO))


def test_a_key_flag_or_module_that_does_not_exist_is_found(tmp_path):
    keys = {"train.lr", "model.lora.r", "checkpoint.async"}
    doc = ("`train.lr`, `--set model.lora.r=8`, `checkpoint.async: true`, `model.safetensors`, `metrics.jsonl`, "
           "`model.layers.0.mlp.weight`\n\n`train.learning_rate`, `model.lora.rank`, `checkpoint.asynch`\n")
    assert unknown_keys(doc, keys) == ["train.learning_rate", "model.lora.rank", "checkpoint.asynch"]

    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "common.py").write_text('parser.add_argument("--out")\n')
    (tmp_path / "bench" / "x.py").write_text('parser.add_argument("--steps")\n')
    flags = {"train": {"--set", "--fresh"}, "plan": {"--model"}}
    doc = ("```bash\nraysft train c.yaml --fresh --set a=1   # --not-a-flag in a comment\nraysft plan c.yaml \\\n"
           "    --modle x\npython bench/x.py --steps 3 --out o --stpes 4\nraysft trian c.yaml\n"
           "python bench/gone.py\n```\n\n`raysft train --frsh` and `raysft: error: ...`\n")
    assert unknown_flags(doc, flags, tmp_path) == [
        "raysft plan --modle", "bench/x.py --stpes", "raysft trian: no such command", "bench/gone.py: no such script",
        "raysft train --frsh"]

    (tmp_path / "raysft" / "distributed").mkdir(parents=True)
    (tmp_path / "raysft" / "distributed" / "__init__.py").write_text("")
    (tmp_path / "raysft" / "distributed" / "layout.py").write_text("class ParallelDims:\n    pass\n")
    (tmp_path / "raysft" / "parallel").mkdir()
    (tmp_path / "raysft" / "parallel" / "__init__.py").write_text("")
    doc = ("raysft/distributed/layout.py, `raysft.distributed.layout.ParallelDims`, raysft/distributed/, "
           "distributed/layout, data/chat.jsonl\n\nraysft/parallel/layout.py, raysft.parallel.layout, "
           "raysft.distributed.layout.Gone, parallel/layout.py\n")
    assert missing_modules(doc, tmp_path, relative=True) == [
        "raysft/parallel/layout.py", "raysft.parallel.layout", "raysft.distributed.layout.Gone", "parallel/layout.py"]


# --- user docs say what the software does, not how it was built ---------------------------------------------------

# The words a user doc must not hold: the history of the project (what was measured when, by whom, on a borrowed
# machine, what it was before) goes to docs/dev/ or the git log; README.md and docs/*.md say what raysft does now.
HISTORY = {
    "a commit hash": r"(?<![\w/.\-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w\-])",
    "a date": r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b",
    "an issue number": r"\bissues?[ \-]#?\d+",
    "a before note": r"\((?:before|was)\b",
    "a clock time": r"\bUTC\b|`date`",
    "a borrowed GPU": r"\b(?:lent|borrowed|device[\- ]minutes|device calls?|device tool|device lease)\b|\$OUT\b|"
                      r"KINDS\.md|\bcarry: ",
    "a work session": r"\b(?:this|next|other|earlier|GPU) sessions?\b|\bsessions'",
    "a branch or tree": r"\bthis (?:branch|worktree|tree)\b",
}


def history_words(markdown: str) -> list[str]:
    """Each place a document speaks of how the project was built, as `line N: what: the words`."""
    found = []
    for number, line in enumerate(markdown.splitlines(), 1):
        for what, pattern in HISTORY.items():
            found += [f"line {number}: {what}: {m.group(0)}" for m in re.finditer(pattern, line, re.I)]
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_user_docs_say_what_raysft_does_not_how_it_was_built(path):
    assert history_words(path.read_text()) == [], \
        f"{path.relative_to(REPO)}: history belongs in docs/dev/ or the git log"


def test_words_about_how_the_project_was_built_are_found():
    doc = ("Measured on 2026-11-29 at 1d19153 (issue 47; see issue-39), `date` 03:03-03:24 UTC.\n"
           "4.1 s (before: 7.2 s) and 1.00 (was 2.10).\n"
           "No device was lent for this; run it with the device tool, `--out \"$OUT\"`, in the next session.\n"
           "Compared with this tree.\n"
           "A decade of faced beads: 1024 tokens, sha256 deadbeef, ray#33073, the issues users see; a pytest "
           "session fixture, once per session; before the first step.\n")
    assert [f.split(": ", 1)[1] for f in history_words(doc)] == [
        "a commit hash: 1d19153", "a date: 2026-11-29", "an issue number: issue 47", "an issue number: issue-39",
        "a clock time: `date`", "a clock time: UTC", "a before note: (before", "a before note: (was",
        "a borrowed GPU: lent", "a borrowed GPU: device tool", "a borrowed GPU: $OUT", "a work session: next session",
        "a branch or tree: this tree"]


# --- docs/METRICS.md lists everything raysft writes to metrics.jsonl ----------------------------------------------

def written_to_metrics(repo: Path) -> tuple[set[str], set[str]]:
    """The events and the step fields raysft's source writes to metrics.jsonl, read off the code as it writes them:
    every `.event("name", ...)` call (and gen_log's EVENTS, logged by variable); the trainer's step record (`host`,
    its dict and updates), the fields StepTotals.reduce adds (`row.update`), the eta, the validation passes' records
    (evaluation.py, preference_eval.py) and the names of the objective's and the memory tier's step metrics."""
    source = {p.relative_to(repo / "raysft").as_posix(): p.read_text() for p in (repo / "raysft").rglob("*.py")}
    events = {name for text in source.values() for name in re.findall(r"\.event\(\s*\"(\w+)\"", text)}
    gen_log = re.search(r"^EVENTS = \(([^)]*)\)", source.get("training/gen_log.py", ""), re.M)
    events |= set(re.findall(r"\"(\w+)\"", gen_log.group(1))) if gen_log else set()

    def kwargs(call: str, text: str) -> set[str]:
        """The keyword names of every call of `call` in `text`, at the call's own level of parentheses."""
        names = set()
        for m in re.finditer(rf"{call}\(", text):
            depth, start = 1, m.end()
            for i in range(start, len(text)):
                depth += {"(": 1, ")": -1, "[": 1, "]": -1, "{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    break
                if depth == 1 and (i == start or text[i] == ",") and (name := re.match(r",?\s*(\w+)=(?!=)", text[i:])):
                    names.add(name.group(1))
        return names
    fields = set()
    trainer = source.get("training/trainer.py", "")
    host = re.search(r"\bhost = \{(.*?)\}\n", trainer, re.S)
    fields |= set(re.findall(r"\"(\w+)\":", host.group(1))) if host else set()
    fields |= kwargs(r"host\.update", trainer) | set(re.findall(r"host\[\"(\w+)\"\] =", trainer))
    metrics = source.get("training/metrics.py", "")
    fields |= kwargs(r"row\.update", metrics) | set(re.findall(r"\"(\w+)\": round\(eta", metrics))
    for module in ("training/evaluation.py", "training/preference_eval.py", "training/preference.py",
                   "checkpoint/checkpointer.py"):
        text = source.get(module, "")
        fields |= set(re.findall(r"\"((?:eval|memory)_\w+|eval/[\w/]+)\"", text))
        fields |= set(re.findall(r"host=\{\"(\w+)\"", text))
    names = re.search(r"^REWARD_METRICS = \(([^)]*)\)\s*^LOGIT_METRICS = \(([^)]*)\)", 
                      source.get("model/preference_loss.py", ""), re.M | re.S)
    fields |= set(re.findall(r"\"([\w/]+)\"", " ".join(names.groups()))) if names else set()
    fields -= {"loss_tokens", "flops", "loss_sum"}  # held for the reduction, not written (StepTotals.HOST, DEVICE)
    return events, fields


def missing_from_reference(reference: str, repo: Path) -> list[str]:
    listed = set(re.findall(r"`([\w/]+)`", reference))
    events, fields = written_to_metrics(repo)
    return sorted(f"event {e}" for e in events - listed) + sorted(f"field {f}" for f in fields - listed)


def test_metrics_reference_lists_every_event_and_step_field_the_code_writes():
    events, fields = written_to_metrics(REPO)
    assert {"start", "resume", "checkpoint", "gen_eval", "memory_tier_off"} <= events, "the scan finds no events"
    assert {"loss", "lr", "peak_mem_gb", "tokens_per_s", "eval_loss", "rewards/margins", "eta_s"} <= fields
    assert missing_from_reference((REPO / "docs" / "METRICS.md").read_text(), REPO) == [], \
        "docs/METRICS.md: list each with its unit"


def test_an_event_or_field_the_reference_lacks_is_found(tmp_path):
    training = tmp_path / "raysft" / "training"
    training.mkdir(parents=True)
    (training / "trainer.py").write_text(
        'host = {"step": 1, "loss_tokens": 2, "lr": lr}\nhost.update(skipped=s, queue_depth=q)\n'
        'host["loss_scale"] = 1\nself.log.event("start", world_size=2)\nself.log.event(\n    "new_event", x=1)\n')
    (training / "metrics.py").write_text("row.update(loss=l / n, grad_norm=g)\n")
    (training / "gen_log.py").write_text('EVENTS = ("gen_eval", "gen_eval_late")\n')
    reference = "| `step` | `lr` | `skipped` | `loss_scale` | `loss` | `grad_norm` | `start` | `gen_eval` |"
    assert missing_from_reference(reference, tmp_path) == [
        "event gen_eval_late", "event new_event", "field queue_depth"]
