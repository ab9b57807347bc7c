"""Write a directory of files atomically: a crash never leaves a half-written dataset behind."""
import os
import shutil
import tempfile
from contextlib import contextmanager


@contextmanager
def atomic_directory(out_dir: str, replace: bool = False, last: tuple[str, ...] = ()):
    """Yield a temporary directory to write into; move its files into out_dir only on success.

    If out_dir does not exist, the temporary directory is renamed onto it (one atomic step).
    If it exists: replace=True swaps the whole directory (old contents removed); replace=False
    moves each file in with os.replace (each file atomic; other files in out_dir untouched), the
    files named in `last` (e.g. an index) after all the others. On error the temporary is deleted.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield tmp
        if not os.path.exists(out_dir):
            os.rename(tmp, out_dir)
        elif replace:
            trash = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(trash, "old"))
            os.rename(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            names = sorted(os.listdir(tmp), key=lambda n: (n in last, n))
            for name in names:
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            os.rmdir(tmp)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
