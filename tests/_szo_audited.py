"""``python -m szo`` with an audit hook that reports every file-system write under $SZO_AUDIT_ROOT.

For tests/test_distributed_cli.py: launched by torchrun, each rank prints one line
``AUDIT rank R EVENT PATH`` (stderr) per write (open for writing, mkdir, rename/replace, remove)
below the root, so the test can check that only rank 0 writes.
"""
import os
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _install(root: str, rank: str) -> None:
    root = os.path.realpath(root)

    def under(path) -> bool:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return False
        p = os.path.realpath(path)
        return p == root or p.startswith(root + os.sep)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
            paths = [path] if writes else []
        elif event in ("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree"):
            paths = [args[0]]
        elif event == "os.rename":  # os.rename and os.replace
            paths = [args[0], args[1]]
        else:
            return
        for p in paths:
            if under(p):
                sys.stderr.write(f"AUDIT rank {rank} {event} {os.fsdecode(p) if isinstance(p, bytes) else p}\n")

    sys.addaudithook(hook)


if __name__ == "__main__":
    _install(os.environ["SZO_AUDIT_ROOT"], os.environ.get("RANK", "0"))
    from szo.cli import main

    sys.exit(main(sys.argv[1:]))
