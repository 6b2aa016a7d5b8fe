"""Print the root of the pip package nvidia-nccl-cu13 of this interpreter, or nothing.

Run by FindNcclByVersion.cmake. `nvidia.nccl` is a namespace package (no __file__), so its first
__path__ entry is the root. Under pip's build isolation the environment's own site-packages are
hidden from sys.path, yet the extension will run next to the torch installed there: look in the
interpreter's sysconfig site directories as well.
"""

import os
import sysconfig


def pip_nccl_root() -> str:
    try:
        import nvidia.nccl

        roots = list(nvidia.nccl.__path__)
    except ImportError:
        roots = []
    paths = sysconfig.get_paths()
    roots += [os.path.join(paths[key], "nvidia", "nccl") for key in ("platlib", "purelib")]
    for root in roots:
        if os.path.isfile(os.path.join(root, "include", "nccl.h")):
            return root
    return ""


if __name__ == "__main__":
    print(pip_nccl_root())
