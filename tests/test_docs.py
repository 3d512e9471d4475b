"""Every command the docs give a user to copy runs: README.md and docs/**/*.md, each fenced ```bash /
```sh block (every line a command) and ```console block (the lines after `$ `), in one working directory
(the repository's entries linked in), the docs in order (offline.md makes the tiny model finetune.md uses).

A command runs as written and must exit 0 without a traceback, unless

- a rule below skips it, for the reason it gives (a synopsis with placeholders, the suite itself, a
  benchmark, a cluster planner search, slurm, the GPU machine's set-up), or
- a marker on the line before its block says otherwise (an HTML comment, unseen in the rendered page):
      <!-- doc-test: skip: REASON -->          not run, for REASON
      <!-- doc-test: dry-run -->               train.py with --dry-run (and torchrun's --world-size)
      <!-- doc-test: refused -->               must be refused: exit 1, `error:` lines only
      <!-- doc-test: add SCRIPT FLAGS... -->   FLAGS appended to each SCRIPT command: the suite's size

What is skipped is listed in docs/tests.md ("Doc commands not run"), which this test keeps equal to the
docs: a new command is run, or skipped with its reason written there. A fenced block without a language
whose lines start like a command fails: label it (bash, console) so it is run or skipped.

train.py and scripts/convert.py run in the warm gloo workers (tests/jobs_docs.py; torchrun's
--nproc-per-node is the world size; train.py with --num-workers 0, as the daemonic workers start no
data-loader processes), scripts/prepare_data.py and Python heredocs in this process, a benchmark
(scripts/bench_*.py) in its smoke form: --smoke appended, its main in this process, its ranks on the
warm workers (tests/scripts.py warm_worlds), its exit status its main's (`> FILE` writes its stdout
there)."""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import shlex
from dataclasses import dataclass, field

import pytest

from tests.dist import run_distributed
from tests.scripts import load_script, warm_worlds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = ["README.md", "docs/offline.md", "docs/finetune.md"]  # finetune.md uses offline.md's tiny/qwen3
DOCS = FIRST + sorted(p for p in (os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                              recursive=True)) if p not in FIRST)
LINKED = ("train.py", "arguments.py", "scripts", "recipes", "megatron_ext", "data")
SKIPS_PAGE = os.path.join(ROOT, "docs", "tests.md")
SKIPS_BEGIN, SKIPS_END = "<!-- doc commands not run: begin -->", "<!-- doc commands not run: end -->"

# (pattern, why it is not run): the first that matches a command skips it
RULES = (
    (r"(^|\s)(N|R|X|HF_DIR|CKPT|RUN|OUT_DIR|REPO|DIR|YAML)(\s|$|/)|\[--|\s\.\.\.(\s|$)|recipes/X\.yaml",
     "a synopsis: its placeholders stand for the user's values"),
    (r"^git clone ", "clones the repository: the suite runs in a clone"),
    (r"^make ", "builds the virtual environment (and runs the suite): the suite runs in what it builds"),
    (r"-m pytest", "the test suite itself"),
    (r"scripts/plan\.py|\s--plan(\s|$)", "plans a cluster recipe: a trace and a search, about a minute of CPU "
                                         "each; tests/planner/ checks the planner"),
    (r"scripts/bench_overlap\.py", "a benchmark of six 2- and 4-process layouts; tests/test_scripts.py runs "
                                   "its smoke form on one (tp2)"),
    (r"(^|\s)sbatch\s", "submits a slurm job; tests/test_slurm.py runs the batch script (DRY_RUN)"),
    (r"-m pip |^export ", "sets up the GPU machine"),
    (r"scripts/gpu_check\.py(?!.*--cpu-smoke)", "needs a GPU; tests/test_gpu_check.py runs its --cpu-smoke"),
    (r"scripts/gpu_run\.sh", "the device run: gpu_check on a GPU machine (--fetch downloads the wheels it "
                             "installs there); tests/test_gpu_check.py runs gpu_check's --cpu-smoke"),
)
PYTHON = {"python", "python3", ".venv/bin/python", ".venv/bin/python3"}
TORCHRUN = {"torchrun", ".venv/bin/torchrun"}
COMMAND_START = re.compile(r"^(\$ |(python3?|\.venv/bin/\w+|torchrun|make|sbatch|git) |"
                           r"([A-Z_]+=\S+ )+(\\|sbatch|python|torchrun|\.venv))")
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")


@dataclass
class Command:
    doc: str
    line: int
    text: str
    markers: list = field(default_factory=list)

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _blocks(doc: str):
    """(language, first line number of the body, body lines, markers) of each fenced block."""
    lines = open(os.path.join(ROOT, doc)).read().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)", lines[i])
        if not m:
            i += 1
            continue
        markers, k = [], i - 1
        while k >= 0 and re.match(r"^\s*<!--\s*doc-test:", lines[k]):
            markers.insert(0, re.match(r"^\s*<!--\s*doc-test:\s*(.*?)\s*-->", lines[k]).group(1))
            k -= 1
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        yield m.group(1), i + 2, lines[i + 1:end], markers
        i = end + 1


def commands(doc: str) -> list[Command]:
    out = []
    for lang, first, body, markers in _blocks(doc):
        if lang not in ("bash", "sh", "console"):
            continue
        j = 0
        while j < len(body):
            line = body[j]
            start = j
            if lang == "console":
                if not line.startswith("$ "):
                    j += 1
                    continue
                line = line[2:]
            elif not line.strip() or line.lstrip().startswith("#"):
                j += 1
                continue
            text = [line]
            while text[-1].rstrip().endswith("\\") and j + 1 < len(body):
                j += 1
                text[-1] = text[-1].rstrip()[:-1]
                text.append(body[j].strip())
            heredoc = HEREDOC.search(" ".join(text))
            if heredoc:
                while j + 1 < len(body) and body[j + 1].strip() != heredoc.group(1):
                    j += 1
                    text.append("\n" + body[j])
                j += 1
            out.append(Command(doc, first + start, " ".join(text) if not heredoc else "".join(
                [text[0]] + text[1:]) , markers))
            j += 1
    return out


def unlabeled_commands(doc: str) -> list[str]:
    """Lines of blocks without a language that start like a command."""
    return [f"{doc}:{first + k}: {line}" for lang, first, body, _ in _blocks(doc) if not lang
            for k, line in enumerate(body) if COMMAND_START.match(line)]


def _marker(cmd: Command, kind: str):
    for m in cmd.markers:
        if m == kind or m.startswith(kind + ":") or m.startswith(kind + " "):
            return m[len(kind):].lstrip(": ").strip() or True
    return None


def skipped(cmd: Command) -> str | None:
    """Why the command is not run, or None."""
    reason = _marker(cmd, "skip")
    if reason:
        return reason
    head = cmd.text.split("\n", 1)[0]
    for pattern, why in RULES:
        if re.search(pattern, head):
            return why
    return None


def skip_table() -> str:
    rows = ["| command | doc | why not run |", "|---|---|---|"]
    for doc in DOCS:
        for cmd in commands(doc):
            why = skipped(cmd)
            if why:
                head = " ".join(cmd.text.split("\n", 1)[0].split())
                shown = head if len(head) <= 90 else head[:87] + "..."
                shown = shown.replace("|", "\\|")
                rows.append(f"| `{shown}` | {doc} | {why} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# running a command
# ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    rc: int
    out: str
    err: str


def _split(cmd: Command) -> list[list[str]]:
    """The command's simple commands (`a && b`), each as words with its environment assignments
    dropped (OMP_NUM_THREADS, PYTHONPATH: the suite's own)."""
    words = shlex.split(cmd.text, comments=True)
    parts, part = [], []
    for w in words + ["&&"]:
        if w == "&&":
            while part and re.match(r"^[A-Z_]+=", part[0]):
                part.pop(0)
            parts.append(part)
            part = []
        else:
            part.append(w)
    return [p for p in parts if p]


def _with_markers(cmd: Command, script: str, argv: list[str], world: int) -> list[str]:
    for m in cmd.markers:
        if m.startswith("add "):
            target, *flags = m[len("add "):].split()
            if target == script:
                argv = argv + flags
    if _marker(cmd, "dry-run") and script == "train.py":
        argv = argv + ["--dry-run", "--world-size", str(world)]
    return argv


def _in_process(workdir: str, fn) -> Result:
    out, err, rc = io.StringIO(), io.StringIO(), 0
    here = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                fn()
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
                if isinstance(e.code, str):
                    print(e.code, file=err)
    finally:
        os.chdir(here)
    return Result(rc, out.getvalue(), err.getvalue())


def _benchmark_smoke(workdir: str, script: str, argv: list[str]) -> Result:
    """A benchmark's command in its smoke form (--smoke appended); `> FILE` receives its stdout."""
    target = None
    if ">" in argv:
        at = argv.index(">")
        argv, target = argv[:at], argv[at + 1]
    name = os.path.basename(script)[:-3]

    def main():
        with warm_worlds():
            status = load_script(name).main([*argv, "--smoke"])
        if isinstance(status, int) and status:
            raise SystemExit(status)

    result = _in_process(workdir, main)
    if target is not None and not result.rc:
        with open(os.path.join(workdir, target), "w") as f:
            f.write(result.out)
    return result


def run(cmd: Command, workdir: str) -> Result:
    heredoc = HEREDOC.search(cmd.text.split("\n", 1)[0])
    if heredoc:  # `[mkdir -p D &&] python - <<'EOF' ... `: the script, in this process
        head, _, body = cmd.text.partition("\n")
        for part in _split(Command(cmd.doc, cmd.line, head[:heredoc.start()])):
            if part[:2] == ["mkdir", "-p"]:
                for d in part[2:]:
                    os.makedirs(os.path.join(workdir, d), exist_ok=True)
            elif part[0] not in PYTHON or part[1:] != ["-"]:
                raise AssertionError(f"{cmd.where()}: only `python - <<EOF` heredocs are run here: {part}")
        source = body.rsplit("\n", 1)[0] if body.rstrip().endswith(heredoc.group(1)) else body
        return _in_process(workdir, lambda: exec(compile(source, cmd.where(), "exec"), {"__name__": "__main__"}))
    result = Result(0, "", "")
    for part in _split(cmd):
        world = 1
        if part[0] in TORCHRUN:
            rest = part[1:]
            while rest and not rest[0].endswith(".py"):
                flag = rest.pop(0)
                if flag.startswith("--nproc-per-node") or flag.startswith("--nproc_per_node"):
                    world = int(flag.split("=", 1)[1]) if "=" in flag else int(rest.pop(0))
                else:
                    raise AssertionError(f"{cmd.where()}: torchrun {flag}: only --nproc-per-node is launched here")
            script, argv = rest[0], rest[1:]
        elif part[0] in PYTHON:
            script, argv = part[1], part[2:]
        else:
            raise AssertionError(f"{cmd.where()}: {part[0]}: not a command this test runs; skip it with a "
                                 "reason (a rule, or a marker)")
        argv = _with_markers(cmd, script, argv, world)
        if script in ("train.py", "scripts/convert.py"):
            if _marker(cmd, "dry-run"):
                world = 1
            if script == "train.py":  # the pool's processes are daemonic: no data-loader worker processes
                argv = argv + ["--num-workers", "0"]
            ranks = run_distributed(world, "tests.jobs_docs:run_entry", cwd=workdir, script=script, argv=argv)
            result = Result(max(r["rc"] for r in ranks), ranks[0]["stdout"], ranks[0]["stderr"])
        elif script == "scripts/prepare_data.py":
            result = _in_process(workdir, lambda: load_script("prepare_data").main(argv))
        elif re.fullmatch(r"scripts/bench_\w+\.py", script):
            result = _benchmark_smoke(workdir, script, argv)
        else:
            raise AssertionError(f"{cmd.where()}: {script}: not an entry point this test runs; skip it with a "
                                 "reason (a rule, or a marker)")
        if result.rc:
            break
    return result


def problem(cmd: Command, result: Result) -> str | None:
    if _marker(cmd, "refused"):
        lines = [line for line in result.err.splitlines() if line.strip()]
        if result.rc == 1 and lines and all(line.startswith("error: ") for line in lines):
            return None
        return f"{cmd.where()}: expected a refusal (exit 1, error: lines only), got exit {result.rc}: {result.err[-600:]}"
    if result.rc != 0 or "Traceback" in result.err:
        return f"{cmd.where()}: exit {result.rc}: {(result.err or result.out)[-1500:]}"
    return None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), root / name)
    os.makedirs(root / "docs")  # where a benchmark's command writes its results (not the repository's docs/)
    return str(root)


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------
def test_no_command_hides_in_an_unlabeled_block():
    assert [line for doc in DOCS for line in unlabeled_commands(doc)] == []


def test_the_commands_not_run_are_listed_with_their_reasons():
    """docs/tests.md's table of the commands not run is the docs' own: a command added to the docs is
    run, or appears there with why not (regenerate it from skip_table())."""
    page = open(SKIPS_PAGE).read()
    listed = page.split(SKIPS_BEGIN, 1)[1].split(SKIPS_END, 1)[0].strip() if SKIPS_BEGIN in page else ""
    assert listed == skip_table(), "docs/tests.md: paste tests.test_docs.skip_table() between the markers"


@pytest.mark.parametrize("doc", DOCS)
def test_doc_commands_run(doc, workdir):
    failed = []
    for cmd in commands(doc):
        if skipped(cmd):
            continue
        found = problem(cmd, run(cmd, workdir))
        if found:
            failed.append(found)
    assert failed == []


def test_negative_controls(tmp_path):
    """A broken command fails, a refusal that is not expected fails, an unlabeled command is seen."""
    doc = tmp_path / "d.md"
    doc.write_text("text\n\n```\npython train.py --recipe recipes/tiny_dense.yaml --dry-run\n```\n\n"
                   "<!-- doc-test: refused -->\n```bash\npython train.py --recipe recipes/tiny_dense.yaml "
                   "--mock-data --dry-run\n```\n\n```bash\npython train.py --recipe recipes/tiny_dense.yaml \\\n"
                   "    --mock-data --lora-rnak 8 --dry-run\n```\n")
    rel = os.path.relpath(str(doc), ROOT)
    assert unlabeled_commands(rel) == [f"{rel}:4: python train.py --recipe recipes/tiny_dense.yaml --dry-run"]
    expect_refused, typo = commands(rel)
    assert typo.line == 13 and typo.text.endswith("--lora-rnak 8 --dry-run")
    refused, mistyped = (problem(cmd, run(cmd, ROOT)) for cmd in (expect_refused, typo))
    assert refused is not None
    assert mistyped is not None and mistyped.startswith(f"{rel}:13: exit 1: error: --lora-rnak=8: no such flag")
