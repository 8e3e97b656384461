"""OUT/ safety: what --overwrite may replace, interrupts, leftovers of killed runs, permissions,
and what the artifact records about the machine that exported it.

Every case here once went wrong: ``--overwrite`` deleted a user's folder, SIGTERM left a
``.OUT.tmp-*`` behind forever, artifacts came out 0700/0600 under umask 022, a tokenizer file
linked to /etc/passwd was copied into the artifact, and the manifest recorded the exporting
machine's absolute path.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bitmtp_edge.format.manifest import MANIFEST, read_manifest, verify_files
from export.out_folder import host_tag
from tests.export_fixtures import checkpoint, copy_ckpt, run_cli
from tests.test_export_bad_input import assert_refused

REPO = Path(__file__).resolve().parents[1]


def exported(tmp_path: Path, name: str = "out") -> Path:
    out = tmp_path / name
    result = run_cli(checkpoint("bitnet-online"), out, "--quiet")
    assert result.exit_code == 0, result.output
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- what --overwrite may replace ---------------------------------------------------------

def test_overwrite_refuses_a_folder_that_is_not_an_artifact(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.txt").write_text("four years of work")
    line = assert_refused(run_cli(checkpoint("bitnet-online"), out, "--overwrite"), out, str(out),
                          "not a BitMTP artifact", out_existed=True)
    assert "replaces only an artifact" in line
    assert (out / "thesis.txt").read_text() == "four years of work"


def test_overwrite_refuses_an_artifact_folder_holding_a_file_it_did_not_write(tmp_path):
    out = exported(tmp_path)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert_refused(run_cli(checkpoint("bitnet-online"), out, "--overwrite"), out, str(out), "'notes.txt'",
                   "never deletes files it did not write", out_existed=True)
    assert snapshot(out) == before


def test_overwrite_refuses_a_file_and_a_link_and_leaves_no_old_folder(tmp_path):
    target = exported(tmp_path, "real")
    before = snapshot(target)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert_refused(run_cli(checkpoint("bitnet-online"), link, "--overwrite"), link, str(link), "symbolic link",
                   out_existed=True)
    assert link.is_symlink() and snapshot(target) == before
    plain = tmp_path / "file"
    plain.write_text("not a folder")
    assert_refused(run_cli(checkpoint("bitnet-online"), plain, "--overwrite"), plain, str(plain), "is a file",
                   out_existed=True)
    assert plain.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "link", "real"]


def test_overwrite_replaces_an_artifact_and_keeps_nothing_of_it(tmp_path):
    out = exported(tmp_path)
    result = run_cli(checkpoint("bitmtp"), out, "--overwrite", "--quiet")
    assert result.exit_code == 0, result.output
    assert read_manifest(out).mtp is not None
    assert siblings(out) == []


def test_the_old_device_flag_says_it_was_renamed(tmp_path):
    out = tmp_path / "out"
    result = run_cli(checkpoint("bitnet-online"), out, "--device", "orin-nano-8gb")
    assert result.exit_code == 2 and "--device was renamed --board" in result.output
    assert "--board orin-nano-8gb" in result.output and not out.exists()


# --- permissions ----------------------------------------------------------------------------

@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_artifact_modes_follow_the_umask(tmp_path, umask, folder_mode, file_mode):
    previous = os.umask(umask)
    try:
        out = exported(tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == folder_mode
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "weights.safetensors" in modes and set(modes.values()) == {file_mode}, modes


# --- interrupts and leftovers ---------------------------------------------------------------

SLOW_EXPORT = """
import sys, time
from pathlib import Path
import export.writer as writer

real = writer.write_artifact_files

def slow(folder, *args, **kwargs):
    manifest = real(folder, *args, **kwargs)
    Path(sys.argv[1]).write_text(str(folder))
    time.sleep(120)
    return manifest

writer.write_artifact_files = slow
from export.cli import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("replace", [False, True], ids=["new", "overwrite"])
def test_sigterm_during_the_write_removes_the_temporary_folder(tmp_path, replace):
    out = exported(tmp_path) if replace else tmp_path / "out"
    before = snapshot(out) if replace else None
    marker = tmp_path / "writing"
    argv = [sys.executable, "-c", SLOW_EXPORT, str(marker), str(checkpoint("bitnet-online")), str(out)]
    proc = subprocess.Popen(argv + (["--overwrite"] if replace else []), cwd=REPO, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the export never reached the write"
            time.sleep(0.1)
        tmp = Path(marker.read_text())
        assert tmp.is_dir() and tmp.name.startswith(f".out.tmp-{host_tag()}-{proc.pid}-")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert rc == 143, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert siblings(out) == []
    if replace:
        assert snapshot(out) == before
    else:
        assert not out.exists()


def test_leftovers_of_dead_exports_are_removed_and_others_reported(tmp_path):
    out = exported(tmp_path)
    host, dead = host_tag(), dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead_tmp": f".out.tmp-{host}-{dead}-a1b2c3d4",
            "dead_old": f".out.old-{host}-{dead}",
            "live_tmp": f".out.tmp-{host}-{live.pid}-e5f6g7h8",
            "other_host": f".out.tmp-otherhost-{dead}-i9j0k1l2",
            "legacy": ".out.tmp-m3n4o5p6",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "weights.safetensors").write_bytes(b"partial")
        result = run_cli(checkpoint("bitnet-online"), out, "--overwrite", "--quiet")
        assert result.exit_code == 0, result.output
        result = run_cli(checkpoint("bitnet-online"), out, "--overwrite")
        assert result.exit_code == 0, result.output
    finally:
        live.kill()
        live.wait()
    assert siblings(out) == sorted([names["live_tmp"], names["other_host"], names["legacy"]])
    err = result.stderr
    assert f"export process {live.pid} still runs" in err and "host otherhost" in err and "older exporter" in err


def test_dead_leftovers_are_removed_and_reported(tmp_path):
    out = tmp_path / "out"
    dead = dead_pid()
    stale = tmp_path / f".out.tmp-{host_tag()}-{dead}-a1b2c3d4"
    stale.mkdir()
    result = run_cli(checkpoint("bitnet-online"), out)
    assert result.exit_code == 0, result.output
    assert f"removed {stale.name}, left by export process {dead}" in result.stderr
    assert siblings(out) == []


def test_an_interrupted_replacement_is_rolled_back_not_deleted(tmp_path):
    """Killed between "old artifact moved aside" and "new one renamed in": OUT/ is missing and
    the only copy of the previous artifact is the .old folder. It goes back, never to the bin."""
    previous = exported(tmp_path, "previous")
    before = snapshot(previous)
    out = tmp_path / "out"
    previous.rename(tmp_path / f".out.old-{host_tag()}-{dead_pid()}")
    result = run_cli(checkpoint("bitmtp"), out)
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert "restored" in result.stderr
    assert snapshot(out) == before and siblings(out) == []


# --- what the checkpoint may make the artifact carry ----------------------------------------

def test_tokenizer_file_linking_out_of_the_checkpoint_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    ckpt = copy_ckpt("bitnet-online", tmp_path / "ckpt")
    (ckpt / "chat_template.jinja").symlink_to(secret)
    out = tmp_path / "out"
    assert_refused(run_cli(ckpt, out), out, str(ckpt / "chat_template.jinja"), "outside the checkpoint folder")


def test_tokenizer_links_inside_the_checkpoint_and_into_the_hub_cache_are_fine(tmp_path):
    """snapshots/<rev>/tokenizer_config.json -> ../../blobs/<sha> is how the HF cache stores files."""
    repo = tmp_path / "models--org--tiny"
    snap = copy_ckpt("bitnet-online", repo / "snapshots" / "0123abc")
    (repo / "blobs").mkdir()
    blob = repo / "blobs" / "f00d"
    (snap / "tokenizer_config.json").rename(blob)
    (snap / "tokenizer_config.json").symlink_to(Path("../../blobs/f00d"))
    (snap / "chat_template.jinja").write_text("{{ messages }}")
    (snap / "alias.jinja").symlink_to("chat_template.jinja")
    out = tmp_path / "out"
    result = run_cli(snap, out, "--quiet")
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer_config.json").read_bytes() == blob.read_bytes()
    assert not (out / "tokenizer_config.json").is_symlink()


def test_manifest_records_the_checkpoints_name_not_the_machines_path(tmp_path):
    ckpt = copy_ckpt("bitnet-online", tmp_path / "my-checkpoint")
    out = tmp_path / "out"
    assert run_cli(ckpt, out, "--quiet").exit_code == 0
    text = (out / MANIFEST).read_text()
    assert read_manifest(out).source["name"] == "my-checkpoint"
    assert str(tmp_path) not in text and "path" not in json.loads(text)["source"]


def test_embedded_artifact_names_its_checkpoint_and_still_verifies():
    import bitmtp_edge

    folder = Path(bitmtp_edge.__file__).parent / "embedded" / "model"
    manifest = read_manifest(folder)
    assert "path" not in manifest.source and manifest.source["name"] == "bitmtp-d8-27m"
    assert not any(isinstance(v, str) and v.startswith("/") for v in manifest.source.values())
    verify_files(folder, manifest)  # every sha256 the manifest lists still matches


@pytest.mark.parametrize("kind", ["file", "link"])
def test_write_artifact_replacing_a_file_or_a_link_leaves_no_old_entry(tmp_path, kind):
    """The library writer (the tests' helper) once renamed a file/link to .NAME.old-PID and
    then failed to rmtree it, leaving it behind for good."""
    from bitmtp_edge.format.manifest import load_tensors, write_artifact
    from tests.helpers import random_model, write_test_artifact

    src = write_test_artifact(random_model(), tmp_path / "src")
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("x")
    else:
        (tmp_path / "elsewhere").mkdir()
        out.symlink_to(tmp_path / "elsewhere")
    write_artifact(out, read_manifest(src), load_tensors(src), {"tokenizer.json": src / "tokenizer.json"},
                   overwrite=True)
    assert out.is_dir() and not out.is_symlink() and (out / MANIFEST).is_file()
    assert siblings(out) == []
    if kind == "link":
        assert (tmp_path / "elsewhere").is_dir()  # the link went, not what it pointed to


# --- an existing empty OUT/ (``mkdir OUT`` first) ------------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_an_empty_existing_folder_is_used_as_the_target(tmp_path, flags):
    """`mkdir OUT` then export once said "already exists; pass --overwrite", and --overwrite
    then refused it as "not a BitMTP artifact". An empty folder holds nothing to lose."""
    out = tmp_path / "out"
    out.mkdir()
    result = run_cli(checkpoint("bitnet-online"), out, "--quiet", *flags)
    assert result.exit_code == 0, result.output
    verify_files(out, read_manifest(out))
    assert siblings(out) == []


def test_a_folder_that_fills_during_the_export_is_never_replaced(tmp_path):
    """Something written into the empty OUT/ during the export is neither moved aside nor
    deleted: OUT/ is checked again before the move, and the move itself is one rename(2),
    which fails on a folder that is not empty."""
    from export import ExportError
    from export.out_folder import _move_into_place, staged_folder

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ExportError, match="not a BitMTP artifact"):
        with staged_folder(out, note=lambda m: None) as tmp:
            (tmp / "manifest.json").write_text("{}")
            (out / "thesis.txt").write_text("four years of work")
    assert sorted(p.name for p in out.iterdir()) == ["thesis.txt"] and siblings(out) == []
    tmp = tmp_path / ".out.tmp-x"  # the last instant: it fills between that check and the rename
    tmp.mkdir()
    with pytest.raises(ExportError, match="no longer empty"):
        _move_into_place(tmp, out, tmp_path / ".out.old-x", replace_artifact=False)
    assert (out / "thesis.txt").read_text() == "four years of work"


@pytest.mark.parametrize("make", ["folder", "file", "link", "artifact with a file of mine"])
def test_overwrite_is_suggested_only_where_it_would_be_accepted(tmp_path, make):
    out = tmp_path / "out"
    if make == "folder":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif make == "file":
        out.write_text("mine")
    elif make == "link":
        out.symlink_to(exported(tmp_path, "real"))
    else:
        exported(tmp_path)
        (out / "notes.txt").write_text("mine")
    line = assert_refused(run_cli(checkpoint("bitnet-online"), out), out, str(out), out_existed=True)
    assert "pass --overwrite" not in line
    again = assert_refused(run_cli(checkpoint("bitnet-online"), out, "--overwrite"), out, str(out), out_existed=True)
    assert again.partition(": ")[2] == line.partition(": ")[2]  # --overwrite changes nothing for it


def test_an_existing_artifact_suggests_overwrite(tmp_path):
    out = exported(tmp_path)
    assert_refused(run_cli(checkpoint("bitnet-online"), out), out, str(out), "already exists",
                   "pass --overwrite", out_existed=True)
