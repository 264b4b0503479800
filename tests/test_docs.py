"""Every code block of README.md and docs/*.md is run or checked here, so that a snippet cannot rot.

- ```python blocks are executed, each in a fresh namespace in an empty directory. A block that needs a model
  to watch says so with an HTML comment on the line above it, ``<!-- prelude: NAME -->``: the code of
  ``PRELUDES[NAME]`` below runs first (tiny sizes, a second at most).
- ```bash blocks are checked line by line: ``make`` targets exist in the Makefile; ``pip install`` lines name
  this package with its own extras (from a checkout or a git address: no package index holds gradwatch) or
  one of its dependencies; ``gradwatch ...`` commands run on a small run the test records first; test files
  and scripts named exist. A line no rule knows fails the test: add a rule for it.
- ```text blocks are output samples and are not run. Any other fence language fails.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

PLAIN = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loss_fn = nn.MSELoss()
loader = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(4)]
"""

LIGHTNING = """
import torch
from torch import nn
import lightning.pytorch as pl


class TinyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        return torch.utils.data.DataLoader(data, batch_size=8)


model = TinyModule()
"""

# The plain set-up, then a run whose step 120 meets a NaN input, recorded with save_batch=True into runs/exp1.
INCIDENT = (
    PLAIN
    + """
import gradwatch

with gradwatch.watch(model, optimizer, log_dir="runs/exp1", save_batch=True, console=False) as gw:
    for step in range(121):
        x, y = loader[step % len(loader)]
        if step == 120:
            x = torch.full_like(x, float("nan"))
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""
)

PRELUDES = {"plain": PLAIN, "lightning": LIGHTNING, "incident": INCIDENT}

# What a `$VAR` in a shell line stands for: REPO is "the address you would clone from".
SHELL_VARS = {"REPO": ROOT.as_uri()}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # line of the opening fence (1-based)
    lang: str
    prelude: str | None
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = re.match(r"^<!-- prelude: (\w+) -->$", lines[i - 1]) if i else None
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(page, i + 1, fence.group(1), above.group(1) if above else None, code))
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in code_blocks(page)]


def of_lang(*langs: str) -> list[Any]:
    return [pytest.param(b, id=b.id) for b in BLOCKS if b.lang in langs]


def test_every_block_says_what_it_is() -> None:
    unknown = [(b.id, b.lang) for b in BLOCKS if b.lang not in ("python", "bash", "text")]
    assert not unknown, "fence each block as ```python (run), ```bash (checked) or ```text (output sample)"
    bad = [(b.id, b.prelude) for b in BLOCKS if b.prelude is not None and b.prelude not in PRELUDES]
    assert not bad, f"unknown prelude; known: {sorted(PRELUDES)}"


@pytest.mark.parametrize("block", of_lang("python"))
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    if block.prelude:
        exec(compile(PRELUDES[block.prelude], f"<prelude {block.prelude}>", "exec"), namespace)  # noqa: S102
    # Blank lines in front keep the page's own line numbers in a traceback.
    exec(compile("\n" * block.line + block.code, str(block.page), "exec"), namespace)  # noqa: S102


# ---- shell blocks


def shell_lines(code: str) -> list[list[str]]:
    """The commands of a shell block, as argument lists (comments dropped, `$VAR`s expanded)."""
    joined = code.replace("\\\n", " ")
    out = []
    for line in joined.split("\n"):
        args = shlex.split(line, comments=True)
        if args:
            out.append([re.sub(r"\$(\w+)", lambda m: SHELL_VARS[m.group(1)], a) for a in args])
    return out


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))


def check_make(args: list[str], cwd: Path) -> None:
    targets = [a for a in args if not a.startswith("-") and "=" not in a]
    assert targets, "a bare `make` runs the first target by chance: name one"
    assert set(targets) <= make_targets(), f"no such make target: {set(targets) - make_targets()}"


def dependency_names() -> set[str]:
    return {Requirement(r).name for r in PYPROJECT["dependencies"]}


def check_requirement(spec: str) -> None:
    extras = set(PYPROJECT["optional-dependencies"])
    checkout = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
    if checkout:  # `pip install .` or `pip install ".[extra]"` in a checkout
        assert set(filter(None, (checkout.group(1) or "").split(","))) <= extras, (spec, extras)
        return
    req = Requirement(spec)
    if req.name == PYPROJECT["name"]:
        assert req.url and req.url.startswith("git+"), f"{spec}: no package index holds gradwatch; give a git address"
        assert req.extras <= extras, (spec, extras)
    else:
        assert req.name in dependency_names(), f"{spec}: not a dependency of gradwatch"


def check_pip(args: list[str], cwd: Path) -> None:
    assert args[0] == "install", args
    rest = iter(args[1:])
    for arg in rest:
        if arg in ("--index-url", "--extra-index-url"):
            assert next(rest).startswith("https://"), args
        elif arg.startswith("-"):
            raise AssertionError(f"add a rule for pip option {arg}")
        else:
            check_requirement(arg)


def check_python(args: list[str], cwd: Path) -> None:
    if args[:2] == ["-m", "pytest"]:
        paths = [a for a in args[2:] if not a.startswith("-")]
    elif args[:2] == ["-m", "pip"]:
        return check_pip(args[2:], cwd)
    else:
        paths = args[:1]
    for p in paths:
        assert (ROOT / p.split("::")[0]).exists(), f"{p} does not exist"
    return None


def check_gradwatch(args: list[str], cwd: Path) -> None:
    from gradwatch.cli import main

    assert PYPROJECT["scripts"]["gradwatch"] == "gradwatch.cli:main"  # the command the pages name
    old = os.getcwd()
    os.chdir(cwd)
    try:
        code = main(args)
    except SystemExit as exc:  # argparse refused the arguments
        code = exc.code
    finally:
        os.chdir(old)
    assert code == 0, f"gradwatch {shlex.join(args)} exited with {code}"


COMMANDS = {
    "make": check_make,
    "pip": check_pip,
    "python": check_python,
    ".venv/bin/python": check_python,
    "gradwatch": check_gradwatch,
}


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding runs/exp1: a short recorded run with one NaN step, for the `gradwatch` lines."""
    cwd = tmp_path_factory.mktemp("docs_run")
    namespace: dict[str, Any] = {}
    old = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(INCIDENT, "<prelude incident>", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(old)
    return cwd


@pytest.mark.parametrize("block", of_lang("bash"))
def test_shell_block_holds(block: Block, recorded_run: Path) -> None:
    for args in shell_lines(block.code):
        while args and re.fullmatch(r"\w+=\S*", args[0]):  # VAR=value in front of a command
            args = args[1:]
        assert args[0] in COMMANDS, f"{block.id}: no rule checks `{shlex.join(args)}`: add one to COMMANDS"
        COMMANDS[args[0]](args[1:], recorded_run)


# ---- the checks themselves can fail


def test_a_shell_line_no_rule_knows_fails() -> None:
    block = Block(ROOT / "README.md", 1, "bash", None, "curl https://example.invalid | sh\n")
    with pytest.raises(AssertionError, match="no rule checks"):
        test_shell_block_holds(block, ROOT)


@pytest.mark.parametrize(
    "line",
    [
        'pip install "gradwatch[lightning]"',  # no package index holds gradwatch
        'pip install ".[lightnin]"',  # no such extra
        "pip install numpy",  # not a dependency
        "make tests",  # no such target
        ".venv/bin/python -m pytest tests/test_nothing_here.py",
        "gradwatch summary no/such/run",
    ],
)
def test_a_rotten_shell_line_fails(line: str, recorded_run: Path) -> None:
    with pytest.raises(AssertionError):
        test_shell_block_holds(Block(ROOT / "README.md", 1, "bash", None, line + "\n"), recorded_run)


def test_a_rotten_python_block_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block = Block(ROOT / "README.md", 1, "python", "plain", "import gradwatch\ngradwatch.watch(model, optimizr)\n")
    with pytest.raises(NameError):
        test_python_block_runs(block, tmp_path, monkeypatch)


# ---- what the pages promise about installing and reading them


def test_the_lightning_extra_brings_both_namespaces() -> None:
    # The quick start imports lightning.pytorch; the callback also serves pytorch_lightning's Trainer.
    names = {Requirement(r).name for r in PYPROJECT["optional-dependencies"]["lightning"]}
    assert {"lightning", "pytorch-lightning"} <= names


def test_the_package_asks_torch_for_a_lower_bound_only() -> None:
    (torch,) = [Requirement(r) for r in PYPROJECT["dependencies"] if Requirement(r).name == "torch"]
    assert {s.operator for s in torch.specifier} == {">="}


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target}"
        if anchor:
            assert anchor in anchors(dest), f"{page.name}: {target}: no such heading in {dest.name}"


def linked_pages(page: Path) -> set[Path]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    targets = (t.partition("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+://", t))
    return {(page.parent / t).resolve() for t in targets if t.endswith(".md")}


def test_every_docs_page_is_reached_from_the_readme() -> None:
    """Each page is linked from the README or from a page the README leads to (contributor pages need not
    crowd the README)."""
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop().resolve()
        if page not in reached and page.exists():
            reached.add(page)
            todo += linked_pages(page)
    missing = [p.name for p in PAGES[1:] if p.resolve() not in reached]
    assert not missing


def test_the_readme_links_each_user_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if p.name not in CONTRIBUTOR_PAGES and f"(docs/{p.name})" not in readme]
    assert not missing


#: Pages for people who change gradwatch, reached from another docs page rather than from the README.
CONTRIBUTOR_PAGES = {"architecture.md"}


def kinds_in(table: str, column: int) -> set[str]:
    cells = "\n".join(row.split(" | ")[column] for row in table.strip().split("\n")[2:])
    cells = cells.replace("`update_ratio_high`/`_low`", "`update_ratio_high`, `update_ratio_low`")
    return set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", cells))


def first_table_after(text: str, heading: str) -> str:
    rest = text.split(heading + "\n", 1)[1]
    return next(chunk.strip() for chunk in rest.split("\n\n") if chunk.strip().startswith("|"))


def test_the_readme_table_and_the_findings_page_list_the_same_kinds() -> None:
    short = first_table_after((ROOT / "README.md").read_text(), "## What it catches")
    full = first_table_after((ROOT / "docs" / "findings.md").read_text(), "## Every kind")
    assert kinds_in(short, 1) == kinds_in(full, 0)
    assert len(kinds_in(full, 0)) > 30


def test_the_readme_reads_in_one_go() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) < 200
    for heading in ("## What it catches", "## Set-up: two commands", "## Quick start: plain loop",
                    "## Quick start: Lightning", "## Where the results go", "## Install"):
        assert heading in readme
    assert "make demo" in readme and "make test" in readme and "](docs/img/" in readme
