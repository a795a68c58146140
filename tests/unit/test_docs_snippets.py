"""README.md and docs/*.md say what is true today: every ```python block runs as written (each in a
fresh interpreter, in a scratch folder), unless it is listed in SKIP with the reason; every
``s4w ...`` command line they show parses with today's ``s4w``.  The examples themselves run in
tests/unit/test_examples.py (train_tiny, read_container) and tests/integrations/test_examples.py
(the framework examples, with what their docstrings claim)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from s4w_core import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: python blocks that do not run here, by (file, the block's first line); each with its reason
SKIP: dict[tuple[str, str], str] = {
    ("docs/INTEGRATIONS.md", "from s4w_lightning import S4CheckpointIO"):
        "a fragment: needs a LightningModule and data; examples/lightning_char_lm.py is its runnable form",
    ("docs/INTEGRATIONS.md", "from s4w_transformers import S4Callback, restore_checkpoint"):
        "a fragment: needs a model and a dataset; examples/hf_tiny_gpt2.py is its runnable form",
    ("docs/INTEGRATIONS.md", "from s4w_core import S4StorageWriter, S4StorageReader"):
        "needs S3 and a process group; examples/dcp_fsdp.py is its runnable form",
    ("docs/INTEGRATIONS.md", "import torch.distributed.checkpoint as dcp"):
        "a fragment: needs an FSDP2 model and a process group; benchmarks/dcp_fsdp.py --cpu-smoke is its runnable form",
    ("docs/INTEGRATIONS.md", "import lightning as L"):
        "a fragment: needs a LightningModule; tests/integrations/dcp/lightning_fsdp_worker.py is its runnable form",
    ("docs/OBSERVABILITY.md", "from s4w_core import obs"):
        "fragments: a wandb callback, and a server on the fixed port 9464 (tests/unit/test_obs.py covers both)",
    ("docs/STORE.md", "import s4w_core"): "S3: s3://bucket/run1 and an endpoint on 127.0.0.1:8333",
    ("docs/STORE.md", 'store = s4w_core.CheckpointStore("s3://bucket/run1", max_pending_bytes=8 << 30)'):
        "S3: s3://bucket/run1, and a training loop (train_step) around it",
    ("docs/STORE.md", 'store = s4w_core.CheckpointStore("s3://bucket/run1", fast_tier="/local/nvme/run1", fast_keep_last=2)'):
        "S3 and a local NVMe folder",
}

#: placeholders in the documented command lines, and what stands in for them
PLACEHOLDERS = {"URL": "store", "PATH": "x.pt", "N": "1", "FILE.png": "x.png", "SECONDS": "5", "IN": "a.s4w",
                "OUT": "b.s4w", "STORE": "store"}


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    """The fenced blocks of ``lang`` ("" for plain ones): (file, line of the fence, text)."""
    out = []
    for doc in DOCS:
        block: list[str] | None = None
        start, info = 0, ""
        for n, ln in enumerate(doc.read_text().splitlines(), 1):
            if ln.startswith("```"):
                if block is None:
                    block, start, info = [], n, ln[3:].strip()
                else:
                    if info == lang:
                        out.append((str(doc.relative_to(ROOT)), start, "\n".join(block) + "\n"))
                    block = None
            elif block is not None:
                block.append(ln)
    return out


PYTHON = _blocks("python")


def _first(code: str) -> str:
    return next(ln for ln in code.splitlines() if ln.strip()).strip()


@pytest.mark.parametrize(("doc", "line", "code"), PYTHON, ids=[f"{d}:{n}" for d, n, _ in PYTHON])
def test_python_block_runs(doc: str, line: int, code: str, tmp_path: Path) -> None:
    reason = SKIP.get((doc, _first(code)))
    if reason is not None:
        pytest.skip(reason)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")]), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{doc}:{line} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"


def test_every_skip_names_a_block_that_exists() -> None:
    """A skip whose block was edited or removed would silently stop the check."""
    have = {(d, _first(c)) for d, _, c in PYTHON}
    assert not set(SKIP) - have, sorted(set(SKIP) - have)
    assert len(PYTHON) - len(SKIP) >= 3  # README's quick start and store blocks, OBSERVABILITY's logging


def _commands() -> list[tuple[str, int, str]]:
    """Every documented ``s4w ...`` command line (bash blocks and plain blocks)."""
    out = []
    for doc, line, code in _blocks("bash") + _blocks(""):
        for i, ln in enumerate(code.splitlines()):
            if ln.startswith("s4w ") and not re.match(r"s4w (save|load) ok", ln):  # log lines, not commands
                cmd = re.split(r"\s#|\s{2,}", ln)[0]  # drop the comment / the description column
                out.append((doc, line + 1 + i, cmd))
    return out


COMMANDS = _commands()


@pytest.mark.parametrize(("doc", "line", "cmd"), COMMANDS, ids=[f"{d}:{n}" for d, n, _ in COMMANDS])
def test_documented_command_parses(doc: str, line: int, cmd: str) -> None:
    words = shlex.split(re.sub(r"\[N \.\.\.\]", "", cmd))[1:]
    argv = [PLACEHOLDERS.get(w.strip("[]"), w.strip("[]")) for w in words]
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{doc}:{line}: `{cmd}` does not parse with today's s4w (exit {e.code})")
    assert callable(args.func)


def test_commands_were_found() -> None:
    names = {c.split()[1] for _, _, c in COMMANDS}
    assert {"info", "verify", "convert", "selftest", "ls", "restore", "stats", "rm", "pin", "gc"} <= names, names


def test_readme_setup_commands_name_what_exists() -> None:
    """README's two set-up commands (the main job, and `bash .ci/run`) and the extras it names: the
    example script, each extra in pyproject.toml, the torch pin CI installs, and CI's test command."""
    readme = (ROOT / "README.md").read_text()
    bash = "\n".join(code for doc, _, code in _blocks("bash") if doc == "README.md")
    pyproject = (ROOT / "pyproject.toml").read_text()
    table = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", table, re.MULTILINE))
    ci = (ROOT / ".ci" / "run").read_text()
    main_job = re.search(r"pip install (torch==\S+) && pip install -e \"\.\[(\w+)\]\" \\\n\s+&& python (\S+\.py)", bash)
    assert main_job is not None, "README's main job command is missing or changed shape"
    pin, extra, script = main_job.groups()
    assert (ROOT / script).is_file() and extra in extras, (script, extra)
    assert f"pip install {pin}" in ci, f"README pins {pin}, .ci/run does not"
    named = set(re.findall(r"`\[([\w-]+)\]`", readme)) | set(re.findall(r"`\.\[([\w,-]+)\]`", readme)[0].split(","))
    assert named and named <= extras, sorted(named - extras)
    assert "`bash .ci/run`" in readme and "\npython -m pytest\n" in ci  # the test command README names
