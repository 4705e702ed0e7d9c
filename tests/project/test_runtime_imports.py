"""Every entry point imports with the runtime dependencies alone (pyproject's `dependencies`,
what `pip install pagedjax` brings): a module another package's test extra happens to provide
here (torch, transformers, hypothesis, pytest, ...) is refused to the importing code."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# Import packages whose distributions are optional extras; their modules are named here.
OPTIONAL: dict[str, str] = {"pagedjax.rl.tunix_rollout": "tunix"}  # module -> its extra

CHILD = textwrap.dedent('''
    import importlib, importlib.metadata as md, pkgutil, re, sys

    def requirement_names(dist):
        names = []
        for req in md.requires(dist) or ():
            if "extra ==" in req:
                continue
            names.append(re.split(r"[ ;<>=!~\\[(]", req, 1)[0].lower().replace("_", "-"))
        return names

    allowed, todo = set(), ["pagedjax"]
    while todo:
        name = todo.pop()
        if name in allowed:
            continue
        allowed.add(name)
        try:
            todo.extend(requirement_names(name))
        except md.PackageNotFoundError:
            pass
    owners = md.packages_distributions()
    first_party = {"pagedjax"}

    class Refuse:
        def find_spec(self, fullname, path=None, target=None):
            top = fullname.split(".", 1)[0]
            dists = {d.lower().replace("_", "-") for d in owners.get(top, ())}
            if top in first_party or not dists or dists & allowed:
                return None
            # What a missing module raises, so an optional import (anyio's of sniffio) falls back
            raise ModuleNotFoundError(f"{fullname} comes from {sorted(dists)}, not a runtime "
                                      "dependency")

    sys.meta_path.insert(0, Refuse())
    optional = set(sys.argv[1].split(",")) if sys.argv[1] else set()
    failures = []
    for package in ("scheduler", "models", "pallas_kernels", "pagedjax"):
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            if info.name in optional:
                continue
            try:
                importlib.import_module(info.name)
            except ImportError as e:
                failures.append(f"{info.name}: {e}")
    import contextlib, io
    from pagedjax.tools import cli
    for command in ("demo", "serve", "router", "capacity", "inspect", "profile", "simulate",
                    "profile-workload"):
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                cli.main([command, "--help"])
        except SystemExit as e:
            if e.code not in (0, None):
                failures.append(f"pagedjax {command} --help exited {e.code}")
        except ImportError as e:
            failures.append(f"pagedjax {command}: {e}")
    print("\\n".join(failures))
    sys.exit(1 if failures else 0)
''')


def test_entry_points_import_with_runtime_dependencies_alone():
    result = subprocess.run([sys.executable, "-c", CHILD, ",".join(OPTIONAL)],
                            capture_output=True, text=True, timeout=300,
                            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
