"""Every fenced block of README.md and docs/tutorial.md is run by a test, or is a sample or a
template that a test holds to the code: a block this file does not know fails
`test_every_block_is_accounted_for` until it is given a test (issue 45).

Run here: the toy cluster's recipe, the worker example against a real daemon, the tutorial's
config through `check-config`, the install lines (slow). Run elsewhere: `make demo`
(tests/test_demo.py runs its command), the service lines (systemd/check-in-container.sh runs them
as written in a systemd container), the GRPO example (tests/e2e/test_grpo_tiny.py). Samples:
the demo's (tests/test_readme.py). Templates: the tutorial's code fragments, whose every call
names a function or class the repository defines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.daemon.conftest import RunningDaemon, daemon_sections, write_config

ROOT = Path(__file__).resolve().parents[1]
README, TUTORIAL = ROOT / "README.md", ROOT / "docs" / "tutorial.md"
BIN = Path(sys.executable).parent  # the venv's dynaresized


def blocks(path: Path) -> list[tuple[str, str, str]]:
    """(section heading, info string, body) of every fenced block, in order."""
    found, section = [], ""
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("#"):
            section = lines[i].lstrip("#").strip()
        if lines[i].startswith("```"):
            info, body = lines[i][3:].strip(), []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            found.append((section, info, "\n".join(body)))
        i += 1
    return found


def block(path: Path, section: str, info: str = "sh") -> str:
    (body,) = [b for s, i, b in blocks(path) if s.startswith(section) and i == info]
    return body


# How each block is covered: (file, section heading starts with, info string) -> test or sample.
COVERED = {
    ("README.md", "Two commands", "sh"): "test_the_two_commands_are_the_makefiles",
    ("README.md", "How it works", ""): "tests/test_readme.py: the demo sample",
    ("README.md", "Install", "sh"): "test_the_install_lines_install_the_cli (slow)",
    ("README.md", "Operate it", "sh"): "test_the_toy_cluster_recipe_runs_as_written",
    ("README.md", "Run it as a service", "sh"): "test_the_service_lines_are_what_the_container_check_runs",
    ("README.md", "Attach your workers", "python"): "test_the_worker_example_attaches_and_reports",
    ("docs/tutorial.md", "Tutorial", ""): "test_the_tutorials_commands_are_the_examples",
    ("docs/tutorial.md", "1. Describe the cluster", "toml"): "test_the_tutorials_config_passes_check_config",
    ("docs/tutorial.md", "2. Your trainer", "python"): "test_the_tutorials_templates_call_what_the_code_defines",
    ("docs/tutorial.md", "3. Your engines", "python"): "test_the_tutorials_templates_call_what_the_code_defines",
    ("docs/tutorial.md", "4. The loop", "python"): "test_the_tutorials_templates_call_what_the_code_defines",
}


def test_every_block_is_accounted_for() -> None:
    unknown = []
    for path in (README, TUTORIAL):
        for section, info, _ in blocks(path):
            name = str(path.relative_to(ROOT))
            if not any(f == name and section.startswith(s) and i == info for f, s, i in COVERED):
                unknown.append((name, section, info))
    assert unknown == [], f"blocks no test runs or checks (add one to tests/test_docs.py): {unknown}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DYNARESIZED_CONFIG"}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def test_the_toy_cluster_recipe_runs_as_written(tmp_path: Path) -> None:
    """The README's five minutes off systemd: a config, a daemon started by hand, simulated GPUs
    attached, and resize, regroup, pause, resume, events and drain on them, through
    DYNARESIZED_CONFIG alone."""
    script = block(README, "Operate it").replace("/tmp/toy", str(tmp_path / "toy"))
    assert "DYNARESIZED_CONFIG=" in script and "dynaresized serve" in script
    run = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=_env(), cwd=tmp_path, start_new_session=True)
    try:
        out, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:  # the script's own process group: its shell and the daemon it started
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    log = (tmp_path / "toy" / "daemon.log")
    assert run.returncode == 0, out + (log.read_text()[-3000:] if log.exists() else "")
    host = int(re.search(r"8 simulated devices attached to \S+ \(an engine and a trainer each, pid (\d+)", out)[1])
    assert "phase       steady" in out and "train 6 : rollout 2" in out
    assert "committed: split train 4 : rollout 4\n" in out
    assert "committed: split train 4 : rollout 4; engines TP-2 [node0:gpu4, node0:gpu5]" in out
    assert "resizing paused" in out and "resizing resumed" in out and '"type": "resize_committed"' in out
    assert "draining" in out
    # the drained daemon is gone, and the simulated GPUs leave with it
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(host, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(host, signal.SIGKILL)
        pytest.fail("the simulated GPUs did not leave within 30 s of the drain")


def test_the_worker_example_attaches_and_reports(tmp_path: Path) -> None:
    code = block(README, "Attach your workers", "python")
    sections = daemon_sections(tmp_path, cluster={"devices": ["node0:gpu0", "node0:gpu1"], "training": ["node0:gpu0"]})
    daemon = RunningDaemon(write_config(tmp_path / "config.toml", sections), sections)
    daemon.start()
    try:
        endpoint = sections["daemon"]["worker_endpoint"]
        run = subprocess.run([sys.executable, "-c", code.replace("tcp://127.0.0.1:5555", endpoint)],
                             capture_output=True, text=True, timeout=60, env=_env())
        assert run.returncode == 0, run.stderr
        events = subprocess.run([BIN / "dynaresized", "events", "--config", str(daemon.config_path)],
                                capture_output=True, text=True, timeout=60, env=_env()).stdout
        assert events.count('"type": "step_observed"') == 3 and '"worker_id": "trainer-0"' in events
    finally:
        daemon.stop()


def test_the_two_commands_are_the_makefiles() -> None:
    """`make demo` runs `dynaresized demo` (tests/test_demo.py runs it, shortened); `make test`
    and `make test-quick` run pytest, `make test-quick` without the slow, torch, vLLM and verl
    tests, as the README says."""
    commands = [x.split("#")[0].strip() for x in block(README, "Two commands").splitlines()]
    assert commands == ["make demo", "make test", "make test-quick"]
    makefile = (ROOT / "Makefile").read_text()
    assert "demo: $(VENV)/.base\n\t$(VENV)/bin/dynaresized demo\n" in makefile
    assert 'QUICK := not slow and not torch and not vllm and not verl' in makefile
    assert "test-quick: $(VENV)/.quick\n\t@$(call pytest,-m \"$(QUICK)\")" in makefile
    assert "dynaresized.cli\", \"demo\"" in (ROOT / "tests" / "test_demo.py").read_text()


def test_the_service_lines_are_what_the_container_check_runs() -> None:
    """systemd/check-in-container.sh (root, systemd-nspawn) runs this section's block line by line,
    as written; tests/daemon/test_systemd.py checks the paths it installs to."""
    check = (ROOT / "systemd" / "check-in-container.sh").read_text()
    assert "awk '/^## Run it as a service/{f=1} f&&/^```sh/{g=1;next} g&&/^```/{exit} g'" in check
    assert "README.md" in check
    lines = [x.split("#")[0].strip() for x in block(README, "Run it as a service").splitlines()]
    assert "dynaresized check-config --config /etc/dynaresized/config.toml" in lines


@pytest.mark.slow  # pip installs the package into a fresh venv
def test_the_install_lines_install_the_cli(tmp_path: Path) -> None:
    script = block(README, "Install").replace("install -q .", f"install -q {ROOT}")
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script + "\ndynaresized --version"], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path, env={**_env(), "PATH": os.environ.get("PATH", "")})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("dynaresized ")


def test_the_tutorials_commands_are_the_examples() -> None:
    """`make example` runs the line below it, which tests/e2e/test_grpo_tiny.py drives in-process."""
    (body,) = [b for s, i, b in blocks(TUTORIAL) if s.startswith("Tutorial")]
    commands = [x.split("#")[0].strip() for x in body.splitlines()]
    assert commands == ["make example", ".venv/bin/python -m examples.grpo_tiny.run --steps 30"]
    assert "example: $(VENV)/.example\n\t$(PY) -m examples.grpo_tiny.run --steps 30\n" in \
        (ROOT / "Makefile").read_text()
    assert "from examples.grpo_tiny.run import" in (ROOT / "tests" / "e2e" / "test_grpo_tiny.py").read_text()


def test_the_tutorials_config_passes_check_config(tmp_path: Path) -> None:
    """Its keys as written (a worker endpoint on the network, with CurveZMQ keys), the paths moved
    under tmp_path and the keys made with the commands its comments give."""
    text = block(TUTORIAL, "1. Describe the cluster", "toml")
    for old in ("/var/lib/dynaresized", "/etc/dynaresized"):
        text = text.replace(old, str(tmp_path / old.strip("/").replace("/", "-")))
    config = tmp_path / "daemon.toml"
    config.write_text(text)
    for command in re.findall(r"`(dynaresized keygen [^`]+)`", text):
        run = subprocess.run(command.split(), capture_output=True, text=True, env=_env(), timeout=60)
        assert run.returncode == 0, run.stderr
    check = subprocess.run([BIN / "dynaresized", "check-config", "--config", str(config)], capture_output=True,
                           text=True, env=_env(), timeout=60)
    assert check.returncode == 0, check.stderr
    assert "tcp://head:5555" in text  # still the multi-host case, not a loopback stand-in


def test_the_tutorials_templates_call_what_the_code_defines() -> None:
    """The code fragments are templates (`...` where your code goes); every class and function they
    call is one the example or the package defines."""
    sources = "\n".join(p.read_text() for p in [*ROOT.glob("examples/grpo_tiny/**/*.py"),
                                                  *ROOT.glob("dynaresized/**/*.py"), *ROOT.glob("backends/**/*.py")])
    defined = set(re.findall(r"(?:def|class) (\w+)", sources))
    for section in ("2. Your trainer", "3. Your engines", "4. The loop"):
        for code in [b for s, i, b in blocks(TUTORIAL) if s.startswith(section) and i == "python"]:
            calls = set(re.findall(r"(?<![\w.])([A-Z]\w+)\(", code)) | set(re.findall(r"\.(\w+)\(", code))
            ours = {c for c in calls if c not in {"MyJob", "append", "range", "max"} and not c.startswith("_")}
            missing = sorted(c for c in ours if c not in defined)
            assert missing == [], f"{section}: the tutorial calls {missing}, which nothing defines"


def test_the_readme_answers_the_first_minute_on_its_first_screen() -> None:
    """issue 45's targets: at most 160 lines; the status, the two commands and the wins-and-losses
    table in the first 60; the diagram and the plot rendered from files in the repository."""
    text = README.read_text()
    lines = text.split("\n")
    assert len(lines) - 1 <= 160
    first = "\n".join(lines[:60])
    for must in ("**Status", "make demo ", "make test ", "| Where we lose |", "<!-- results: end -->"):
        assert must in first, must
    table = text.split("<!-- results: end -->")[0].split("`python -m tests.readme_results --write` -->")[1]
    rows = [x for x in table.strip().split("\n")[2:]]
    assert 0 < len(rows) <= 8 and all(x.count("`") >= 2 for x in rows)  # short, each with its command
    assert any("below 1" in x for x in rows)  # losses too
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text):
        assert (ROOT / image).is_file(), image
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PY) docs/diagram.py docs/diagram.png" in makefile and "--plot docs/run.png" in makefile
    assert "dynaresized simulate --scenario longtail-drift --layout profile --plot docs/run.png" in text
    assert "FIGURE_RUN := simulate --scenario longtail-drift --layout profile" in makefile


@pytest.mark.slow  # draws with matplotlib (the plot extra)
def test_the_diagram_is_what_its_source_draws(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra")
    out = tmp_path / "diagram.png"
    subprocess.run([sys.executable, str(ROOT / "docs" / "diagram.py"), str(out)], check=True, timeout=120)

    def size(path: Path) -> tuple[int, int]:
        head = path.read_bytes()[:24]  # PNG: width and height in the IHDR chunk
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")

    assert size(out) == size(ROOT / "docs" / "diagram.png")


def test_the_readmes_numbers_about_its_commands_are_the_codes() -> None:
    """The counts the README states next to its commands come from the code: the demo's devices and
    steps, the toy cluster's devices and speedup (the tables and the demo sample have generators of
    their own, tests/readme_results.py and tests/readme_demo.py)."""
    from dynaresized.cli import build_parser
    from dynaresized.sim.cluster import VirtualCluster

    text = README.read_text()
    parser = build_parser()
    demo = parser.parse_args(["demo"])
    devices = len(VirtualCluster.builtin(demo.scenario, demo.profile, steps=1).devices)
    assert f"make demo         # the real daemon, {devices} simulated GPUs, {demo.steps} steps:" in text
    toy = parser.parse_args(["toy-cluster"])
    toy_devices = len(VirtualCluster.builtin("longtail-drift", toy.profile, steps=1).devices)
    assert f"# a config for {toy_devices} simulated GPUs" in text and f"attach the {toy_devices} GPUs" in text
    assert f"in cost-model time, {toy.speedup:g}× faster" in text


def test_the_readmes_links_reach_files_and_headings_that_exist() -> None:
    def slug(heading: str) -> str:  # GitHub's anchor of a heading
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    for target in re.findall(r"\]\(([^)]+)\)", README.read_text()):
        path, _, anchor = target.partition("#")
        assert (ROOT / path).is_file(), target
        if anchor:
            headings = [slug(x.lstrip("#")) for x in (ROOT / path).read_text().splitlines() if x.startswith("#")]
            assert anchor in headings, target
