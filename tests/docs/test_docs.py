"""The documentation holds on a fresh clone: every relative link and every repository path named in README.md and
docs/**/*.md exists, the README stays a front page whose measured figures are each in the report its row links, and
every command in the README's bash blocks is run by a test (or, for a GPU launch, dry-run by one). No subprocess, no
import of the package: a few file reads."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").rglob("*.md"))]

# Each command of the README's bash blocks -> where it runs: "tests/...py::test_name" (a test that runs it; the test
# file must name the script) or a CI script that contains the command. "dry run": the test runs the same command with
# --dry-run, because the real one needs GPUs.
README_COMMANDS = {
    "bash train_igpo.sh":
        "tests/e2e/test_e2e_learning.py::test_the_same_seed_gives_the_same_run_and_the_policy_learns",
    "bash scripts/test.sh": ".ci/run",
    "bash train_igpo.sh algorithm.methods=[tool_cost] algorithm.adv_estimator=tool_cost":
        "tests/e2e/test_e2e_methods.py::"
        "test_the_readme_example_method_trains_through_the_real_trainer_and_past_a_spent_tool_budget",
    "bash scripts/install_gpu.sh --plan":
        "tests/launch/test_install_gpu.py::test_plan_without_a_gpu_environment_changes_nothing",
    "IGPO_GPUS=8 MODEL_PATH=/path/to/Qwen3-4B-Thinking-2507 bash train_igpo.sh --dry-run":
        "tests/launch/test_launch_plan.py::test_dry_run_plans_eight_and_one_gpus_without_any_gpu",
    "MODEL_PATH=/path/to/Qwen3-4B-Thinking-2507 TRAIN_FILE=data/train.parquet VAL_FILE=data/qa_test_7src.parquet "
    "bash train_igpo.sh":
        "tests/launch/test_launch_plan.py::test_dry_run_plans_eight_and_one_gpus_without_any_gpu",  # dry run
}

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A repository path: starts at a top-level folder or names a top-level file, and ends in a file extension or "/"
# (so metric names such as `igpo/infra_errors` are not taken for paths); no placeholders, globs or spaces.
TOP_LEVEL = ("igpo/", "tool_server/", "scripts/", "configs/", "tests/", "docs/", "results/", "data/", ".ci/")
TOP_FILES = {"train_igpo.sh", "pyproject.toml", "requirements.txt", "requirements-gpu.txt", "requirements-common.txt",
             "requirements-vllm-cpu.txt", ".env.example", "README.md"}
PATH_CHARS = re.compile(r"^[A-Za-z0-9_./-]+$")
PATH_END = re.compile(r"(\.[A-Za-z0-9]+|/)$")


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def exists(relpath: str) -> bool:
    return (REPO / relpath).exists()


def links(doc: Path):
    """(target as written, repository-relative path) of every relative link of ``doc``."""
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#", 1)[0]).resolve()
        yield target, path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)


def named_paths(doc: Path):
    """Repository paths named in backticks in ``doc`` (``path::test_name`` keeps its test name)."""
    for span in CODE_SPAN.findall(doc.read_text()):
        path, _, test = span.partition("::")
        if not PATH_CHARS.match(path) or "//" in path or not (PATH_END.search(path) or path in TOP_FILES):
            continue
        if path.startswith(TOP_LEVEL) or path in TOP_FILES:
            yield path, test


def test_every_relative_link_exists():
    broken = [f"{rel(doc)}: ({target}) -> {path}" for doc in DOCS for target, path in links(doc) if not exists(path)]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_named_repository_path_exists():
    broken = []
    for doc in DOCS:
        for path, test in named_paths(doc):
            if not exists(path):
                broken.append(f"{rel(doc)}: `{path}` does not exist")
            elif test and not re.search(rf"^\s*(async )?def {re.escape(test)}\(", (REPO / path).read_text(), re.M):
                broken.append(f"{rel(doc)}: `{path}::{test}`: no such test")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 180, (f"README.md has {len(lines)} lines; the front page keeps to 180 (move a comparison's "
                               "reading to docs/findings.md, other detail to docs/)")


FIGURE = re.compile(r"\d{1,3}(?:,\d{3})+|\d+\.\d+")  # 1,566 or 0.031: the figures a reader would quote


def results_rows() -> list[tuple[str, list[str]]]:
    """(figure cell, linked files) of each row of the README's table of measured results."""
    text = README.read_text()
    header = re.search(r"^\|([^\n]*)\|\n\|[-|]+\|\n", text, re.M)
    while header and "figure" not in [c.strip() for c in header.group(1).split("|")]:
        header = re.compile(r"^\|([^\n]*)\|\n\|[-|]+\|\n", re.M).search(text, header.end())
    assert header, "README.md has no table with a 'figure' column (the front page's measured results)"
    column = [c.strip() for c in header.group(1).split("|")].index("figure")
    rows = []
    for line in text[header.end():].splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        targets = [t.split("#", 1)[0] for t in LINK.findall(line) if not re.match(r"^[a-z]+:", t)]
        rows.append((cells[column], targets))
    return rows


def test_every_figure_of_the_readme_is_in_the_report_its_row_links():
    rows = results_rows()
    assert len(rows) >= 5, rows
    missing = []
    for figure, targets in rows:
        reports = [(REPO / t).read_text() for t in targets if t.startswith("results/") and (REPO / t).is_file()]
        assert reports, f"README results row {figure!r} links no report in results/"
        missing += [f"{number} (row {figure!r})" for number in FIGURE.findall(figure)
                    if not any(number in report for report in reports)]
    assert not missing, "README figures not in the reports their rows link:\n" + "\n".join(missing)


def test_no_machine_paths_in_the_docs():
    found = [f"{rel(doc)}: {m}" for doc in [*DOCS, *sorted((REPO / "results").rglob("*.md"))]
             for m in re.findall(r"/work/\S*|/home/\S*", doc.read_text())]
    assert not found, "\n".join(found)


def readme_commands() -> list[str]:
    """Every command line of the README's bash blocks: continuation lines joined, comments and blank lines dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def test_every_readme_command_is_run_by_a_test():
    unregistered = [c for c in readme_commands() if c not in README_COMMANDS]
    assert not unregistered, ("README commands no test runs; add a test that runs each (or dry-runs it) and register "
                              "it in README_COMMANDS:\n" + "\n".join(unregistered))
    stale = [c for c in README_COMMANDS if c not in readme_commands()]
    assert not stale, "README_COMMANDS lists commands the README no longer shows:\n" + "\n".join(stale)


@pytest.mark.parametrize("command", sorted(README_COMMANDS))
def test_the_registered_runner_runs_the_command(command):
    target = README_COMMANDS[command]
    path, _, test = target.partition("::")
    text = (REPO / path).read_text()
    script = next(word for word in command.split() if word.endswith(".sh"))
    if test:
        assert re.search(rf"^\s*(async )?def {re.escape(test)}\(", text, re.M), f"{target}: no such test"
        assert Path(script).name in text, f"{path} never names {script}, so it cannot run `{command}`"
    else:
        assert command in text, f"{path} does not run `{command}`"
