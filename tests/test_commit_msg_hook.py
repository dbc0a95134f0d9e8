""".githooks/commit-msg: a subject of at most 72 characters, then a blank line (CONTRIBUTING.md). Run with every
POSIX shell found here on message files, and once through a real `git commit`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / ".githooks" / "commit-msg"
SHELLS = [shell for shell in ("sh", "dash", "bash") if shutil.which(shell)]


def run_hook(tmp_path: Path, message: str, shell: str = "sh") -> subprocess.CompletedProcess[str]:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message, encoding="utf-8")
    return subprocess.run([shell, str(HOOK), str(path)], capture_output=True, text=True, timeout=30)


GOOD = {
    "subject only": "Add the commit-msg hook\n",
    "subject, blank, body": "Add the commit-msg hook\n\nSubjects over 72 characters are cut in git log --oneline.\n",
    "72 characters exactly": "A" * 72 + "\n\nbody\n",
    "72 characters of two bytes each": "é" * 72 + "\n",
    "git's comments do not count": "# Please enter the commit message\nFix the hook\n# a comment\n\nWhy.\n",
    "leading blank lines are dropped": "\n\nFix the hook\n\nWhy.\n",
    "no final newline": "Fix the hook",
    "trailing spaces on the blank line": "Fix the hook\n   \nWhy.\n",
    "a merge": "Merge branch 'feature/a-very-long-branch-name-that-goes-on-and-on' into main of the project\n"
    "body right away\n",
    "a fixup": "fixup! " + "B" * 80 + "\n",
    "a squash": "squash! " + "B" * 80 + "\n",
    "git commit -v's diff is not the message": "Fix the hook\n\nWhy.\n"
    "# ------------------------ >8 ------------------------\n" + "diff --git a/x b/x\n" + "+" * 100 + "\n",
    "empty (git refuses it itself)": "# only a comment\n",
}

BAD = {
    "73 characters": ("A" * 73 + "\n\nbody\n", "73 characters"),
    "a long subject after comments": ("# comment\n" + "C" * 90 + "\n", "90 characters"),
    "body on the second line": ("Fix the hook\nbecause it broke\n", "second line must be blank"),
    "both": ("D" * 80 + "\nmore\n", "80 characters"),
}


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("name", sorted(GOOD))
def test_a_good_message_passes(tmp_path, name, shell):
    result = run_hook(tmp_path, GOOD[name], shell)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_message_is_refused_saying_why(tmp_path, name, shell):
    message, reason = BAD[name]
    result = run_hook(tmp_path, message, shell)
    assert result.returncode == 1
    assert reason in result.stderr and "CONTRIBUTING.md" in result.stderr


def test_both_faults_are_named_at_once(tmp_path):
    result = run_hook(tmp_path, "E" * 80 + "\nbody\n")
    assert "80 characters" in result.stderr and "second line must be blank" in result.stderr


def test_the_hook_is_executable_posix_sh():
    assert os.access(HOOK, os.X_OK), "git runs only executable hooks: chmod +x .githooks/commit-msg"
    assert HOOK.read_text().startswith("#!/bin/sh\n")
    if shutil.which("dash"):  # Debian's /bin/sh: no bashisms
        subprocess.run(["dash", "-n", str(HOOK)], check=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_commit_runs_the_hook_from_core_hookspath(tmp_path):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull}

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)

    git("init", "-q")
    git("config", "core.hooksPath", str(HOOK.parent))
    (tmp_path / "f").write_text("x\n")
    git("add", "f")
    refused = git("commit", "-q", "-m", "F" * 73)
    assert refused.returncode != 0 and "73 characters" in refused.stderr
    assert git("commit", "-q", "-m", "Add f", "-m", "A file, to commit.").returncode == 0
    assert git("log", "--format=%s").stdout.strip() == "Add f"
