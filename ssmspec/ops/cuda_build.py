"""Loading the one-launch CUDA extensions (torch's JIT loader), safe against interrupted builds.

torch's loader guards each extension's build directory with a file named `lock`, created on
every load and deleted when the load is done; a process killed in between (Ctrl-C during a
first build, a timeout) leaves the file behind, and every later load of that extension waits
for it forever, silently. Here each load first takes an flock on a file of our own in the same
directory. The operating system drops an flock when its holder dies, so whoever holds it knows
that no live process is building or loading that extension (every ssmspec load takes it), and
removes a leftover `lock` with a message instead of waiting on it.
"""
from __future__ import annotations

import fcntl
import os
import sys


def load_inline(name: str, what: str, **kwargs):
    """torch.utils.cpp_extension.load_inline(name=name, **kwargs), built on first use and cached
    under TORCH_EXTENSIONS_DIR, after clearing a lock left there by an interrupted build.
    `what` names the extension for the message that explains the wait of a first build."""
    from torch.utils import cpp_extension

    print(f"ssmspec: loading {what} {name} (built on first use on this machine, ~1 min; cached under "
          "TORCH_EXTENSIONS_DIR)", file=sys.stderr, flush=True)
    # the directory torch's loader itself would pick (and create) for this name
    directory = cpp_extension._get_build_directory(name, False)
    with open(os.path.join(directory, "ssmspec.lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # waits for a live builder or loader, never for a dead one
        left = os.path.join(directory, "lock")
        if os.path.exists(left):
            print(f"ssmspec: removing {left}, left by an interrupted build of {name}", file=sys.stderr, flush=True)
            os.remove(left)
        return cpp_extension.load_inline(name=name, build_directory=directory, **kwargs)
