"""jetson/setup_jetpack6.sh: argument handling and paths, run by bash against recorded board trees.

No Jetson here: the script's read-only probes look under ``BITMTP_BOARD_ROOT`` (a board tree
from tests/fixtures/jetson/boards), ``uname``, ``python3`` and ``nvpmodel`` are stand-ins on
PATH, and ``--dry-run`` prints every command it would run (``+ ...``) without running it. What
this cannot show: that the wheel URLs, the Triton index and the installed stack work on a board.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "jetson" / "setup_jetpack6.sh"
BOARDS = REPO / "tests" / "fixtures" / "jetson" / "boards"
LAYOUT_VENV = "/opt/bitmtp/venv"
LAYOUT_SRC = "/opt/bitmtp/src"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def setup(tmp_path: Path, *args: str, board: str | Path = "orin-nx-16gb", arch: str = "aarch64",
          python_version: str = "3.10", env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the script (always with --dry-run) on a board tree; HOME is an empty temp folder."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        stand_in(bin_dir, "uname", f'echo "{arch}"')
        # The script asks python only for its version during a dry run.
        stand_in(bin_dir, "python3", f'echo "{python_version}"')
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    root = board if isinstance(board, Path) else BOARDS / board / "root"
    nvpmodel = None if isinstance(board, Path) else BOARDS / board / "commands" / "nvpmodel_-q.out"
    if nvpmodel is not None and nvpmodel.exists():
        stand_in(bin_dir, "nvpmodel", f'cat "{nvpmodel}"')
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "BITMTP_BOARD_ROOT")}
    full_env = {**base, "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "BITMTP_BOARD_ROOT": str(root),
                **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--min-free-gb", "0", *args], cwd=tmp_path,
                          env=full_env, capture_output=True, text=True, timeout=60)


def commands(result: subprocess.CompletedProcess) -> list[str]:
    return [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]


def pip_installs(result: subprocess.CompletedProcess) -> list[str]:
    return [c for c in commands(result) if " -m pip " in c]


# --- where it installs -----------------------------------------------------------------------

def test_without_venv_or_virtualenv_pip_gets_user_after_install(tmp_path):
    """`python3 -m pip --user install` is what pip rejects; `pip install --user` is the form."""
    result = setup(tmp_path)
    assert result.returncode == 0, result.stderr
    installs = pip_installs(result)
    assert len(installs) == 4 and all(c.startswith("python3 -m pip install --user ") for c in installs), installs
    assert "pip install --user" in result.stderr


def test_active_virtualenv_is_used_as_is(tmp_path):
    result = setup(tmp_path, env={"VIRTUAL_ENV": str(tmp_path / "venv")})
    assert result.returncode == 0, result.stderr
    assert all(c.startswith("python3 -m pip install ") and "--user" not in c for c in pip_installs(result))


def test_venv_whose_parents_do_not_exist_yet(tmp_path):
    """--venv ~/.venvs/bitmtp on a fresh board: ~/.venvs does not exist, df must not die on it."""
    home = tmp_path / "home"
    venv = home / ".venvs" / "bitmtp"
    result = setup(tmp_path, "--venv", str(venv))
    assert result.returncode == 0, result.stderr
    assert f"GB free under {home}\n" in result.stdout
    cmds = commands(result)
    assert cmds[:2] == [f"mkdir -p {venv.parent}", f"python3 -m venv --system-site-packages {venv}"]
    assert all(c.startswith(f"{venv}/bin/python -m pip install ") and "--user" not in c for c in pip_installs(result))
    assert not (home / ".venvs").exists()  # a dry run creates nothing


def test_relative_venv_is_made_absolute(tmp_path):
    result = setup(tmp_path, "--venv", "venvs/bitmtp")
    assert result.returncode == 0, result.stderr
    assert f"python3 -m venv --system-site-packages {tmp_path}/venvs/bitmtp" in commands(result)


def test_the_layout_path_works_from_an_empty_opt(tmp_path):
    """The README's command, with /opt/bitmtp not created yet (df then looks at /opt or /)."""
    result = setup(tmp_path, "--venv", LAYOUT_VENV + "-test-does-not-exist/venv")
    assert result.returncode == 0, result.stderr
    assert re.search(r"GB free under /\S*\n", result.stdout)


# --- what it installs ------------------------------------------------------------------------

def test_triton_is_pinned_and_the_pin_can_be_changed(tmp_path):
    triton = [c for c in pip_installs(setup(tmp_path)) if "triton" in c]
    assert len(triton) == 1 and triton[0].endswith(" triton==3.6.0") and "--no-deps" in triton[0]
    triton = [c for c in pip_installs(setup(tmp_path, "--triton-version", "3.3.1")) if "triton" in c]
    assert triton[0].endswith(" triton==3.3.1")
    assert not [c for c in pip_installs(setup(tmp_path, "--skip-triton")) if "triton" in c]


@pytest.mark.parametrize("revision, index", [("4.3", "/jp/v61/"), ("3.0", "/jp/v60/")])
def test_torch_wheel_follows_the_jetpack_release(tmp_path, revision, index):
    root = tmp_path / "root"
    shutil.copytree(BOARDS / "orin-nx-16gb" / "root", root)
    (root / "etc" / "nv_tegra_release").write_text(
        f"# R36 (release), REVISION: {revision}, GCID: 1, BOARD: generic, EABI: aarch64, DATE: x\n")
    result = setup(tmp_path, board=root)
    assert result.returncode == 0, result.stderr
    torch = [c for c in pip_installs(result) if "torch-" in c]
    assert len(torch) == 1 and index in torch[0]


def test_board_probes_read_the_board_root(tmp_path):
    result = setup(tmp_path, board="orin-nano-super")
    assert result.returncode == 0, result.stderr
    assert "L4T R36.4.7 (JetPack 6)" in result.stdout
    assert "board: NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super" in result.stdout
    assert "power mode: MAXN_SUPER" in result.stdout
    assert "cuSPARSELt: missing" in result.stdout  # the fixture tree has no /usr/local/cuda


def test_root_needs_no_sudo_and_a_user_does(tmp_path):
    cp = [c for c in commands(setup(tmp_path)) if " cp -a " in c or c.startswith("cp -a ")]
    expected = "cp -a " if os.geteuid() == 0 else "sudo cp -a "
    assert len(cp) == 2 and all(c.startswith(expected) for c in cp), cp


# --- what it refuses -------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--venv"], "--venv needs a value"),
    (["--venv", "--dry-run"], "--venv needs a value"),
    (["--min-free-gb", "lots"], "--min-free-gb takes a whole number of GB, got 'lots'"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, args, message):
    result = setup(tmp_path, *args)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [f"error: {message} (see --help)"]
    assert "==" not in result.stdout  # refused before any check ran


@pytest.mark.parametrize("kwargs, message", [
    ({"arch": "x86_64"}, "not a Jetson (aarch64)"),
    ({"board": "agx-thor"}, "L4T R38.2.0 is not JetPack 6"),
    ({"python_version": "3.12"}, "--python /usr/bin/python3.10"),
])
def test_wrong_platform_is_refused_before_installing_anything(tmp_path, kwargs, message):
    result = setup(tmp_path, **kwargs)
    assert result.returncode == 1 and message in result.stderr
    assert commands(result) == []


def test_missing_release_file_says_how_to_mount_it(tmp_path):
    result = setup(tmp_path, board=tmp_path / "empty-root")
    assert result.returncode == 1 and "-v /etc/nv_tegra_release:/etc/nv_tegra_release:ro" in result.stderr


def test_help_prints_the_header(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "--triton-version V" in result.stdout and LAYOUT_VENV in result.stdout


# --- one layout for the script, the README, the unit and the container ----------------------

def test_readme_unit_dockerfile_and_script_agree_on_the_layout():
    readme = (REPO / "jetson" / "README.md").read_text()
    unit = (REPO / "jetson" / "bitmtp.service").read_text()
    dockerfile = (REPO / "jetson" / "Dockerfile").read_text()
    script = SCRIPT.read_text()
    exec_start = re.search(r"^ExecStart=(\S+)", unit, re.MULTILINE).group(1)
    assert exec_start == f"{LAYOUT_VENV}/bin/bitmtp"
    assert "git clone" in readme and f" {LAYOUT_SRC}" in readme
    assert f"--venv {LAYOUT_VENV}" in readme and f"--venv {LAYOUT_VENV}" in dockerfile
    assert f"{LAYOUT_SRC}/jetson/README.md" in unit
    assert f"COPY . {LAYOUT_SRC}" in dockerfile and f"{LAYOUT_VENV}/bin/bitmtp" in dockerfile
    for path in (LAYOUT_SRC, LAYOUT_VENV, "/opt/bitmtp/artifacts"):
        assert path in script and path in readme
    assert "--venv ~/" not in readme and "/.venvs/" not in unit + dockerfile  # the old home-folder layout


def test_dockerignore_keeps_the_repository_history_and_training_data_out():
    entries = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", "tools/checkpoints", "runs"} <= entries
    assert "bitmtp_edge/embedded" not in entries  # the embedded model is part of the package
