"""The ``xpm-plan`` command of the installed package: fit, predict, plan, max-batch, show and
figures on measurements and memory models offline, as the CMake build's ``xpm-plan`` does (the
same program, its options, output and exit codes: 0 done, 2 bad input, 3 internal error).

    xpm-plan fit measurements.csv --formula 'a*bs*l + c' --variables bs,l --bytes-column peak_bytes \\
        --output memory_model.json

``pip install`` puts the program inside the package (``xpm/bin/xpm-plan``) and this console
script on the PATH; ``xpm-plan probe`` (which probes xpm's bundled tasks) is the CMake build's
alone.
"""
from __future__ import annotations

import os
import pathlib
import sys
from typing import NoReturn, Optional, Sequence


def program_path() -> pathlib.Path:
    """The ``xpm-plan`` program this package carries (it may be missing from a build tree's copy).

    Returns:
        ``<package>/bin/xpm-plan``.
    """
    return pathlib.Path(__file__).resolve().parent / "bin" / "xpm-plan"


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Runs ``xpm-plan`` with ``argv`` (default: this process's arguments), replacing this process.

    Args:
        argv: the arguments after the program name.

    Raises:
        SystemExit: 3, with one line on stderr, when the package holds no ``xpm-plan`` (a build
            tree's copy: use its ``build/bin/xpm-plan``).
    """
    program = program_path()
    if not os.access(program, os.X_OK):
        print(f"xpm-plan: error: this copy of xpm has no program at {program} (a build tree's copy of the "
              "package: run build/bin/xpm-plan, or pip install the package)", file=sys.stderr)
        raise SystemExit(3)
    arguments = list(sys.argv[1:] if argv is None else argv)
    os.execv(program, [str(program), *arguments])


if __name__ == "__main__":
    main()
