"""The artifact folder OUT/: what may be replaced, the atomic write, and leftovers of killed runs.

An export writes into a temporary sibling ``.OUT.tmp-<host>-<pid>-<random>`` and renames it
to OUT/ at the end, so OUT/ is either the old content or the complete new artifact. Replacing
an existing artifact moves it aside to ``.OUT.old-<host>-<pid>`` first, renames the new one
into place, then deletes the old one.

Rules, each protecting something the user may care about:

* ``--overwrite`` replaces only an artifact: a folder whose ``manifest.json`` is a BitMTP
  manifest and that holds nothing but the files the manifest lists (plus its ONNX files).
  A plain file, a link, a non-empty folder without a manifest, or an artifact folder with a
  file of the user's in it (``notes.txt``) is refused, with or without ``--overwrite`` (so no
  refusal suggests it there): the exporter never deletes what it did not write.
* An empty folder (``mkdir OUT`` first, as many users do) is a target like a missing one,
  without ``--overwrite``: the new artifact replaces it by one rename, which fails, leaving
  it alone, if anything was written into it during the export.
* SIGTERM is handled like Ctrl-C (``KeyboardInterrupt``): the temporary folder is removed and,
  if the old artifact was already moved aside, it is moved back.
* ``kill -9`` cannot be caught, so every run first looks for leftovers of earlier runs on OUT/.
  The host and PID in their names say whose they are: a leftover of a process on this host
  that no longer runs is removed (a ``.old`` one whose OUT/ is missing is the previous
  artifact of an interrupted replacement, so it is renamed back to OUT/ instead); one whose
  process still runs, or that comes from another host or an older exporter (no PID in the
  name), is left alone and reported.
* The folder and its files get the permissions a plain ``mkdir``/``cp`` would give under the
  user's umask (0755/0644 under 022), so a service account can read an artifact someone else
  exported.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from bitmtp_edge.format.manifest import FORMAT_NAME, MANIFEST

from .errors import ExportError

# Files an artifact folder may hold besides those its manifest lists: the ONNX graphs
# (``--onnx``) and their temporary siblings while they are being written.
ONNX_FILES = ("model.onnx", "model_draft.onnx", "model.onnx.data")
_ONNX_TMP = re.compile(r"^\.(model\.onnx|model_draft\.onnx|model\.onnx\.data|manifest\.json)\.tmp-\d+$")

Note = Callable[[str], None]


class Terminated(KeyboardInterrupt):
    """SIGTERM during an export: unwinds like Ctrl-C so the temporary folder is removed."""


def host_tag() -> str:
    """This machine's name as it appears in leftover names (letters, digits, '-' and '_')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "localhost"


def check_out(out: Path, overwrite: bool) -> bool:
    """Refuse an OUT/ this export may not write (see the module doc): an artifact without
    ``--overwrite``, and anything else but a missing or empty folder, with or without it.
    True when OUT/ is an artifact the export will replace.

    A refusal suggests ``--overwrite`` only for an artifact: anywhere else it would be refused too."""
    if not out.exists() and not out.is_symlink():
        return False
    if out.is_symlink():
        raise ExportError(out, f"is a symbolic link (to {os.readlink(out)}), and --overwrite replaces only an "
                          "artifact folder", "pass the folder itself, or remove the link")
    if not out.is_dir():
        raise ExportError(out, "is a file, not an artifact folder (--overwrite replaces only an artifact)",
                          "choose another OUT/ (nothing was changed)")
    if _is_empty(out):
        return False  # as after ``mkdir OUT``: nothing to lose, and it is replaced by one atomic rename
    data = _manifest_of(out)
    if data is None:
        raise ExportError(out, "already exists and is not a BitMTP artifact (no BitMTP manifest.json), and "
                          "--overwrite replaces only an artifact",
                          "choose another OUT/, a new or empty folder (nothing was changed)")
    known = {MANIFEST, *data["files"], *ONNX_FILES}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in known and not _ONNX_TMP.match(p.name))
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ExportError(out, f"holds {foreign[0]!r}{more}, which the artifact's manifest does not list "
                          "(--overwrite never deletes files it did not write)",
                          "move them out of the folder, or choose another OUT/")
    if not overwrite:
        raise ExportError(out, "already exists (a BitMTP artifact)", "pass --overwrite to replace it, or choose "
                          "another OUT/")
    return True


def _is_empty(folder: Path) -> bool:
    try:
        return next(folder.iterdir(), None) is None
    except OSError:  # unreadable: not known to be empty, so it gets the artifact checks (and their refusals)
        return False


def _manifest_of(folder: Path) -> dict | None:
    """The folder's manifest.json if it is a BitMTP manifest with a file list, else None."""
    manifest = folder / MANIFEST
    try:
        data = json.loads(manifest.read_text(encoding="utf-8")) if manifest.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME or not isinstance(data.get("files"), dict):
        return None
    return data


def clean_leftovers(out: Path, note: Note) -> None:
    """Deal with ``.OUT.tmp-*`` / ``.OUT.old-*`` siblings that killed runs left (see the module doc)."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return
    tmp_re = re.compile(rf"^\.{re.escape(out.name)}\.tmp-(?:(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-)?[a-z0-9_]+$")
    old_re = re.compile(rf"^\.{re.escape(out.name)}\.old-(?:(?P<host>[A-Za-z0-9_-]+)-)?(?P<pid>\d+)$")
    here = host_tag()
    for entry in sorted(parent.iterdir()):
        m = tmp_re.match(entry.name) or old_re.match(entry.name)
        if m is None or not entry.is_dir() or entry.is_symlink():
            continue
        host, pid = m.group("host"), m.group("pid")
        if pid is None or host is None or host != here:
            whose = "an older exporter" if pid is None else f"host {host}" if host != here else f"pid {pid}"
            note(f"left {entry} alone (from {whose}: cannot tell whether that export still runs); "
                 "remove it when no export is writing to this folder")
        elif _alive(int(pid)):
            note(f"left {entry} alone: export process {pid} still runs")
        elif ".old-" in entry.name and not out.exists() and not out.is_symlink():
            entry.rename(out)
            note(f"restored {out} from {entry.name} (a replacement that was interrupted by a kill)")
        else:
            shutil.rmtree(entry, ignore_errors=True)
            note(f"removed {entry.name}, left by export process {pid} which no longer runs")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (threads may be running)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give ``folder`` and the files in it the modes mkdir/open would give under the umask.

    ``mkdtemp`` makes 0700 and safetensors writes 0600 whatever the umask; an artifact is
    meant to be read by other accounts (the systemd unit's ``bitmtp`` user)."""
    mask = current_umask()
    os.chmod(folder, 0o777 & ~mask)
    for p in folder.iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, 0o666 & ~mask)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` (main thread only: elsewhere Python
    cannot install handlers, and the default action stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged_folder(out: Path, note: Note, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out``; on success it replaces ``out`` atomically.

    ``out`` is checked again (``check_out``) just before the move, since the user may have
    written into it during the export. On any exception (Ctrl-C, SIGTERM, a full disk, that
    check) the temporary folder is removed and ``out`` is as it was."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    tag = f"{host_tag()}-{os.getpid()}"
    with sigterm_as_interrupt():
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{tag}-", dir=parent))
        try:
            yield tmp
            apply_umask(tmp)
            trash = parent / f".{out.name}.old-{tag}"
            with _signals_held():
                replaced = _move_into_place(tmp, out, trash, check_out(out, overwrite))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if replaced:
        try:
            shutil.rmtree(trash)
        except OSError as e:
            note(f"the new artifact is in place, but its predecessor {trash} could not be removed "
                 f"({e.strerror or e}); remove it by hand")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back during the two renames, so that an interrupt cannot fall
    between them (OUT/ moved aside, the new one not yet in place)."""
    held = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _move_into_place(tmp: Path, out: Path, trash: Path, replace_artifact: bool) -> bool:
    """Rename ``tmp`` to ``out``; True when an old ``out`` was moved to ``trash`` for deletion.

    Only an artifact ``check_out`` accepted is moved aside: a missing or empty ``out`` is
    replaced by rename(2) alone, which fails (ENOTEMPTY/EEXIST) if something appeared in it
    since, so a user's file is never moved aside and deleted."""
    if not replace_artifact:
        try:
            tmp.rename(out)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise ExportError(out, "was empty or missing when the export began but is no longer empty (something "
                              "was written into it meanwhile)", "choose another OUT/ (nothing of it was changed)")
        return False
    out.rename(trash)
    try:
        tmp.rename(out)
    except BaseException:
        trash.rename(out)  # put the old artifact back: nothing is lost
        raise
    return True
