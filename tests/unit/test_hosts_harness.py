"""The real-host harness (hosts/): it names what failed, and what ran long, in its own output
(all CI keeps of a guest run); its steps keep their budgets; CI runs its bounded profile."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO, guard


@functools.cache
def harness() -> ModuleType:
    name = "jaild_hosts_run"
    spec = importlib.util.spec_from_file_location(name, REPO / "hosts" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_failed_steps_tests_and_log_tail_are_reported(tmp_path: Path) -> None:
    run = harness()
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_ok" time="1"/>'
        '<testcase classname="tests.b" name="test_bad" time="2">'
        '<failure message="AssertionError: no&#10;second line">trace</failure></testcase>'
        '<testcase classname="tests.c" name="test_err" time="2"><error message="">x</error>'
        "</testcase></testsuite></testsuites>"
    )
    (tmp_path / "test.log").write_text("".join(f"line {i}\n" for i in range(100)))
    lines = run.failure_excerpt(tmp_path, "test")
    assert lines[:2] == ["FAILED tests.b::test_bad: AssertionError: no", "FAILED tests.c::test_err"]
    assert lines[2:] == [f"test.log: line {i}" for i in range(100 - run.EXCERPT_LINES, 100)]
    (tmp_path / "junit.xml").write_text("<not xml")
    assert run.failure_excerpt(tmp_path, "test")[0].startswith("(cannot read junit.xml: ")
    assert run.failure_excerpt(tmp_path, "socket") == []  # no log, no JUnit file


def run_steps(share: Path, script: str, steps: str, budgets: str) -> list[list[str]]:
    """Run ``script`` (bash, with hosts/guest/lib.sh sourced) as the guest would, in
    ``share``; returns results.tsv's rows."""
    env = {"PATH": os.environ["PATH"], "SHARE": str(share), "STEPS": steps, "BUDGETS": budgets,
           "CONSOLE": "/dev/null"}
    prologue = f"source {REPO / 'hosts/guest/lib.sh'}\n"
    subprocess.run(["bash", "-c", prologue + script], env=env, check=False,
                   timeout=guard(120))
    return [line.split("\t") for line in (share / "results.tsv").read_text().splitlines()]


def test_a_step_past_its_budget_is_killed_with_its_children_and_the_next_steps_run(
    tmp_path: Path,
) -> None:
    script = """
    long() { sleep 300 & echo $! > "$SHARE/child.pid"; wait; }
    quick_124() { exit 124; }   # the step's own 124, within its budget: a failure
    fine() { echo fine; }
    export -f long quick_124 fine
    step long long; step quick quick_124; step fine fine; step unwanted fine
    """
    rows = run_steps(tmp_path, script, "long quick fine", "long=1 quick=60")
    assert [r[:2] for r in rows] == [["long", "timeout"], ["quick", "fail"], ["fine", "pass"]]
    assert int(rows[0][2]) >= 1
    log = (tmp_path / "long.log").read_text()
    assert "(budget 1 s)" in log and "TIMEOUT: still running after its budget of 1 s" in log
    assert (tmp_path / "fine.log").read_text().splitlines()[-1] == "fine"
    assert (tmp_path / "current").read_text().strip() == "fine"  # the last step started
    child = int((tmp_path / "child.pid").read_text())
    # the step's own child went with it (timeout signals the step's whole process group)
    status = Path(f"/proc/{child}/stat")
    assert not status.exists() or status.read_text().split()[2] == "Z", "the step's child lives"


def test_control_a_step_without_a_budget_runs_to_its_end(tmp_path: Path) -> None:
    script = """
    short() { sleep 1.5; echo done; }
    export -f short
    step short short
    """
    rows = run_steps(tmp_path, script, "short", "other=1")  # a budget for another step only
    assert [r[:2] for r in rows] == [["short", "pass"]]
    assert (tmp_path / "short.log").read_text().splitlines()[-1] == "done"


def test_the_whole_runs_timeout_names_the_running_step_and_its_budget(tmp_path: Path) -> None:
    run = harness()
    watch = run.Watch(tmp_path, "debian12", {"test": 1200})
    (tmp_path / "results.tsv").write_text("clone\tpass\t2\ndemo\tpass\t300\n")
    (tmp_path / "current").write_text("test\n")
    watch.poll(100.0)
    assert watch.running() == "test" and watch.first_step_at == 100.0
    watch.poll(500.0)  # the same step still running: its start stays
    assert watch.overdue(1000.0, 50) == [
        "TIMEOUT after 50 min in step 'test', which had run 900 s of its 1200 s budget; the "
        "steps after it did not run"]
    (tmp_path / "results.tsv").write_text("clone\tpass\t2\ndemo\tpass\t300\ntest\ttimeout\t1200\n")
    watch.poll(1300.0)
    assert watch.running() is None and watch.failed == ["test"] and not watch.done
    assert watch.overdue(1300.0, 50)[0].startswith("TIMEOUT after 50 min, between steps")


def test_cis_profile_budgets_every_step_and_ci_runs_it() -> None:
    run = harness()
    ci = run.PROFILES["ci"]
    assert ci.provisioned and "test" not in ci.steps
    assert set(ci.budgets_s) == set(ci.steps) and set(ci.steps) < set(run.STEPS)
    assert run.PROFILES["full"].steps == run.STEPS and not run.PROFILES["full"].provisioned
    ci_run = (REPO / ".ci/run").read_text()
    assert re.search(r"make test-hosts HOSTS_ARGS=\"--profile ci\b", ci_run), ci_run
    assert re.search(r"^timeout .* make lint\b", ci_run, re.M), "lint runs in CI, bounded"


def image_module() -> ModuleType:
    name = "jaild_hosts_image"
    spec = importlib.util.spec_from_file_location(name, REPO / "hosts" / "image.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_provisioned_image_is_made_from_what_the_commit_says(tmp_path: Path) -> None:
    image = image_module()
    repo = tmp_path / "repo"
    for f in ("Makefile", "pyproject.toml", "jaild/envs.py", "envs/default.txt",
              "envs/data.txt", "README.md"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_bytes((REPO / f).read_bytes())
    git(repo.parent, "init", "-q", str(repo))
    env = ["-c", "user.name=t", "-c", "user.email=t@t"]

    def commit() -> str:
        git(repo, "add", "-A")
        git(repo, *env, "commit", "-qm", "x")
        return git(repo, "rev-parse", "HEAD")

    first = image.Provision.of_commit(repo, commit())
    makefile = (REPO / "Makefile").read_text()
    apt = re.search(r"(?m)^APT_PACKAGES := (.*)$", makefile)
    extras = re.search(r"(?m)^VENV_EXTRAS := (.*)$", makefile)
    assert apt and extras
    assert first.apt_packages == tuple(apt.group(1).split())
    assert first.venv_extras == extras.group(1) and first.env_names == ("data", "default")
    # the key follows what the environments are made from, and nothing else
    (repo / "README.md").write_text("changed\n")
    assert image.Provision.of_commit(repo, commit()).digest == first.digest
    (repo / "envs/default.txt").write_text("msgpack>=1.0.5\n")
    second = image.Provision.of_commit(repo, commit())
    assert second.digest != first.digest
    # and is read at the commit, not from the work tree
    (repo / "envs/default.txt").write_text("uncommitted\n")
    assert image.Provision.of_commit(repo, git(repo, "rev-parse", "HEAD")) == second
    (repo / "Makefile").write_text("nothing: ;\n")
    with pytest.raises(RuntimeError, match="does not print APT_PACKAGES"):
        image.Provision.of_commit(repo, commit())
