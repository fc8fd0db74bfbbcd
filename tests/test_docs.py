"""The documented commands run as written, so a change that breaks one fails CI.

Code blocks marked ``doc-test:NAME`` in their fence (```` ```bash doc-test:serve ````) are taken
from README.md and docs/serving.md verbatim; only the model (SmolLM2 -> the tiny random Llama,
which `make test` builds in seconds) and the port (8000 -> a free one) are substituted. Every
`ascend-mepic` command in docs/commands.md's table, and every subcommand the CLI has, runs with
``--help``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from ascend_mepic.eval.prepare import prepare_tiny_llama

REPO = Path(__file__).resolve().parents[1]
DOCUMENTED_MODEL = "~/.cache/ascend_mepic/models/smollm2-135m-instruct"
SESSION_TIMEOUT_S = 420
_FENCE = re.compile(r"^```(\w+) doc-test:([\w-]+)\n(.*?)^```$", re.M | re.S)


def doc_blocks() -> dict[str, tuple[str, str, str]]:
    """name -> (file, language, code) for every marked block."""
    blocks: dict[str, tuple[str, str, str]] = {}
    for rel in ("README.md", "docs/serving.md"):
        for lang, name, code in _FENCE.findall((REPO / rel).read_text(encoding="utf-8")):
            assert name not in blocks, f"doc-test:{name} appears twice"
            blocks[name] = (rel, lang, code)
    return blocks


def test_the_docs_mark_their_runnable_blocks():
    assert set(doc_blocks()) == {"serve", "offline", "plain-vllm", "openai-chat"}


def _env() -> dict[str, str]:
    """The caller's environment, this venv's commands first, and vLLM's CPU CI switch: the
    documented engines run in vLLM's compiled mode (Dynamo traces the model with MEPIC's
    attention op, and vLLM splits the graph at it) on Dynamo's ``eager`` backend, as vLLM's own
    CPU CI runs. vLLM's CPU platform overrides a ``compilation_config`` backend with Inductor
    unless ``VLLM_CPU_CI_ENV`` is set, and Inductor's C++ builds of the pieces between attention
    ops (vLLM's own) were most of these tests' time: 324 s for the offline snippet alone."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VLLM_PLUGINS", None)
    env["VLLM_CPU_CI_ENV"] = "1"
    return env


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(prepare_tiny_llama())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _substitute(code: str, model: str, port: int) -> str:
    assert DOCUMENTED_MODEL in code, "the documented model path changed: update this test"
    code = code.replace(DOCUMENTED_MODEL, model).replace(
        "prepare --model smollm2", "prepare --model tiny"
    )
    assert "8000" in code
    return code.replace("8000", str(port))


class _Session:
    """A shell block that starts a server in the background and talks to it, run as written,
    then the Python blocks ``then`` against the same server (no server start of their own);
    the server (and anything else the block started) is killed when it ends."""

    def __init__(
        self,
        name: str,
        model: str,
        tmp_path: Path,
        env: dict[str, str] | None = None,
        then: Sequence[str] = (),
    ) -> None:
        _, lang, code = doc_blocks()[name]
        assert lang == "bash"
        self.name, self.out, self.err = name, tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        port = _free_port()
        script = "set -euo pipefail\n" + _substitute(code, model, port)
        for extra in then:
            _, lang, python = doc_blocks()[extra]
            assert lang == "python"
            script += (
                f"\npython - <<'DOC_TEST_EOF'\n{_substitute(python, model, port)}DOC_TEST_EOF\n"
            )
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                ["bash", "-c", script],
                stdout=out,
                stderr=err,
                env={**_env(), **(env or {})},
                start_new_session=True,
            )

    def finish(self, deadline: float) -> tuple[int | None, str, str]:
        try:
            rc = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._signal_group(sig):
                break
            gone_by = time.monotonic() + 2
            while time.monotonic() < gone_by and self._signal_group(0):
                time.sleep(0.1)
        return rc, self.out.read_text(), self.err.read_text()[-4000:]

    def _signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the block's process group; False once none of it is left."""
        self.proc.poll()  # reap the shell, which would otherwise linger as a zombie
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True


# The evaluation extra (setup.py's EVAL_REQUIRES) less what vLLM itself requires (tqdm,
# tokenizers): serving must not import them, so the README's server runs with them hidden.
HIDDEN_EVAL_PACKAGES = ("matplotlib", "gguf")


def hide_packages(root: Path, names: Sequence[str]) -> str:
    """A folder that, first on PYTHONPATH, makes ``import NAME`` fail for each of ``names``."""
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            f"raise ImportError({name!r} + ' is hidden: no evaluation extra')\n"
        )
    return str(root)


@pytest.fixture(scope="module")
def sessions(tiny_model, tmp_path_factory) -> dict[str, tuple[int | None, str, str]]:
    """Both server sessions at once: most of each is start-up, which overlaps well. The README's
    server runs without the evaluation packages (``pip install -e .``, no ``[eval]``) and with
    ``PROMETHEUS_MULTIPROC_DIR`` set."""
    tmp = tmp_path_factory.mktemp("doc-sessions")
    (tmp / "prometheus").mkdir()
    hidden = {
        "PYTHONPATH": os.pathsep.join(
            [hide_packages(tmp / "hidden", HIDDEN_EVAL_PACKAGES), str(REPO)]
        ),
        # prometheus' multiprocess mode (vLLM's with several API servers): MEPIC's metrics
        # still reach /metrics (through vLLM's stat-logger plugins)
        "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prometheus"),
    }
    running = [
        # serving.md's openai-client example runs against the README's server
        _Session("serve", tiny_model, tmp, env=hidden, then=["openai-chat"]),
        _Session("plain-vllm", tiny_model, tmp),
    ]
    deadline = time.monotonic() + SESSION_TIMEOUT_S
    return {s.name: s.finish(deadline) for s in running}


def _session_output(sessions, name: str) -> str:
    rc, out, err = sessions[name]
    assert rc == 0, f"doc-test:{name} exited {rc}\nstdout:\n{out}\nstderr:\n{err}"
    return out


def test_serving_needs_no_evaluation_package():
    """``pip install -e .`` requires what serving imports, and the evaluation packages only in the
    ``eval`` extra (which ``make setup`` installs); the README's server (``sessions``) runs with
    those vLLM does not need itself hidden."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    lists = {
        t.id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert set(lists["EVAL_REQUIRES"]) == {"matplotlib", "tqdm", "gguf", "tokenizers"}
    assert not set(lists["EVAL_REQUIRES"]) & set(lists["SERVING_REQUIRES"])
    assert '-e ".[eval]"' in (REPO / "Makefile").read_text(encoding="utf-8")


def test_readme_serve_session(sessions):
    out = _session_output(sessions, "serve")
    assert '"chat.completion"' in out and '"content"' in out, out
    assert re.search(r"^ascend_mepic_chunk_misses_total [1-9]", out, re.M), out


def test_serving_md_openai_client_example(sessions):
    """serving.md's official-``openai``-client example (chunk content parts) runs as written
    against the README's server: both questions are answered, and the documents are shared."""
    out = _session_output(sessions, "serve")
    assert re.search(r"^chunk hits: [1-9]", out, re.M), out


def test_serving_md_plain_vllm_command(sessions):
    """The plain vLLM server serves MEPIC, and MEPIC's start-up INFO line comes out through
    vLLM's logging, in vLLM's format (``vllm_integration/logs.py``)."""
    out = _session_output(sessions, "plain-vllm")
    assert '"choices"' in out and '"text"' in out, out
    vllm_format = r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[scheduler\.py:\d+\] MEPIC scheduling path on"
    assert re.search(vllm_format, out), out[-4000:]


def test_readme_offline_snippet(tiny_model):
    """The snippet as documented, with the tiny model, in vLLM's compiled mode (the only
    compiled-mode MEPIC check besides the README's servers; the backend: ``_env``)."""
    _, lang, code = doc_blocks()["offline"]
    assert lang == "python"
    assert DOCUMENTED_MODEL in code
    code = code.replace(DOCUMENTED_MODEL, tiny_model)
    # The engine core in the snippet's process: one import of vLLM, not two (18 s of CPU).
    env = {**_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]


GROUPS = ("bench", "trace")  # commands whose second word is a subcommand


def _documented_commands() -> list[list[str]]:
    """``ascend-mepic`` commands in docs/commands.md's table (linked from the README),
    alternatives expanded."""
    text = (REPO / "docs" / "commands.md").read_text(encoding="utf-8")
    commands = []
    for cell in re.findall(r"^\| `ascend-mepic ([^`]*)` \|", text, re.M):
        words = cell.split()
        if words[0] in GROUPS:
            commands += [[words[0], alt] for alt in words[1].replace("\\", "").split("|")]
        else:
            commands.append([words[0]])
    return commands


def _cli_commands() -> list[list[str]]:
    from ascend_mepic.entrypoints.cli import build_parser

    def subcommands(parser) -> dict:
        return next(
            (a.choices for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"),
            {},
        )

    commands = []
    for name, parser in subcommands(build_parser()).items():
        if name == "serve":  # vLLM's parser: test_serve_help_is_vllms_parser
            continue
        commands += [[name, s] for s in subcommands(parser)] or [[name]]
    return commands


def test_every_cli_command_is_documented_and_has_help(capsys):
    from ascend_mepic.entrypoints.cli import main

    documented = _documented_commands()
    missing = [c for c in _cli_commands() if c not in documented]
    assert not missing, f"CLI commands missing from docs/commands.md's table: {missing}"
    for command in documented:
        with pytest.raises(SystemExit) as e:
            main([*command, "--help"])
        assert e.value.code == 0, command
        assert "usage: ascend-mepic" in capsys.readouterr().out, command


def test_serve_help_is_vllms_parser():
    r = subprocess.run(
        [sys.executable, "-m", "ascend_mepic.entrypoints.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--scheduler-cls" in r.stdout and "--additional-config" in r.stdout


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors (lower case, punctuation dropped, spaces to dashes) and
    explicit ``<a id>`` ones."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # '#' in code is no heading
    anchors = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_links_between_docs_resolve():
    files = [REPO / "README.md", REPO / "CHANGELOG.md", *REPO.glob("docs/*.md")]
    files += [REPO / "tests/README.md", REPO / "requirements/README.md"]
    broken = []
    for f in files:
        text = re.sub(r"^```.*?^```", "", f.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                broken.append(f"{f.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{f.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_options_table_is_generated_from_the_option_models():
    """docs/options.md's option table is scripts/mepic_options.py's output, read from the pydantic
    models the options are validated by (``MepicConfig``, ``TierConfig``)."""
    import runpy

    script = runpy.run_path(str(REPO / "scripts" / "mepic_options.py"))
    doc = (REPO / "docs" / "options.md").read_text(encoding="utf-8")
    assert script["doc_section"](doc) == script["render"](), (
        "docs/options.md's option table differs from the option models: run "
        "`.venv/bin/python scripts/mepic_options.py --write`"
    )


def test_supported_models_table_is_generated_from_the_tests():
    """docs/models.md's supported/refused model tables are scripts/supported_models.py's output,
    which reads the package's support matrix (what tests/engine/test_real_geometry.py checks) and
    tests/core/test_unsupported_models.py's examples."""
    import runpy

    script = runpy.run_path(str(REPO / "scripts" / "supported_models.py"))
    doc = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    assert script["doc_section"](doc) == script["render"](), (
        "docs/models.md's supported-models section differs from what the tests check: run "
        "`.venv/bin/python scripts/supported_models.py --write`"
    )
