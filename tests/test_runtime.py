"""The setup cell's runtime check (lib/runtime.py): the version floors and their messages, Triton installed on first
use where the runtime lacks it, and the package sets of requirements/ that CI runs the Colab editions in."""

from __future__ import annotations

import io
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from lib import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent
SETUP = (ROOT / "tools" / "setup_cell.py").read_text()
SETS = {p.stem: p for p in sorted((ROOT / "requirements").glob("*.txt"))}


def pins(path: pathlib.Path) -> dict[str, str]:
    found = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", path.read_text(), re.MULTILINE)
    return {name.lower(): version for name, version in found}


def test_version_tuple_reads_local_and_prerelease_versions():
    assert runtime.version_tuple("2.11.0+cu128") == (2, 11)
    assert runtime.version_tuple("3.6.0rc1") == (3, 6)
    assert runtime.version_tuple("2.10") == (2, 10)
    with pytest.raises(ValueError, match="not a version"):
        runtime.version_tuple("latest")
    with pytest.raises(TypeError, match="string"):
        runtime.version_tuple(2.9)


def test_a_too_old_torch_is_named_with_its_floor_and_the_fix():
    at_floor = {name: ".".join(map(str, floor)) + ".0" for name, (floor, _) in runtime.FLOORS.items()}
    assert runtime.too_old(at_floor) == []
    messages = runtime.too_old({**at_floor, "torch": "2.5.1+cu124"})
    assert len(messages) == 1
    assert messages[0].startswith("torch 2.5.1+cu124 is older than 2.9, the oldest this course runs on:\n")
    assert "Fix: pip install --upgrade 'torch>=2.9', then restart the kernel." in messages[0]
    assert all(len(line) <= 88 for line in messages[0].splitlines())


def test_a_missing_package_is_named_but_a_missing_triton_is_left_to_the_finder():
    at_floor = {name: ".".join(map(str, floor)) for name, (floor, _) in runtime.FLOORS.items()}
    assert runtime.too_old({**at_floor, "triton": None}) == []
    (message,) = runtime.too_old({**at_floor, "altair": None})
    assert message.startswith("altair is not installed") and "pip install --upgrade 'altair>=5.5'" in message


def test_the_floor_set_is_the_floors_and_every_set_meets_them():
    floor = pins(SETS["floor"])
    for name, (version, _) in runtime.FLOORS.items():
        assert runtime.version_tuple(floor[name]) == version, f"requirements/floor.txt: {name} is not its floor"
    for path in [*SETS.values(), ROOT / "requirements.txt"]:
        assert runtime.too_old({name: pins(path).get(name) for name in runtime.FLOORS}) == [], path.name


def test_each_set_pairs_torch_with_the_triton_the_setup_cell_would_install():
    for name, path in SETS.items():
        pinned = pins(path)
        spec = runtime.TRITON_FOR_TORCH[runtime.version_tuple(pinned["torch"])]
        if "triton" in pinned:
            assert spec == f"triton=={pinned['triton']}", name
        else:  # the CPU runtime: the set says so, and the tool removes what pip brings in
            assert re.search(r"^# without: triton$", path.read_text(), re.MULTILINE), name


def test_a_set_names_its_python_and_its_source():
    for name, path in SETS.items():
        text = path.read_text()
        assert re.search(r"^# python: 3\.\d+$", text, re.MULTILINE), name
        assert "github.com/googlecolab/backend-info" in text and re.search(r"20\d\d-\d\d-\d\d", text), name


def test_triton_is_installed_on_first_import_and_said_in_one_line(monkeypatch):
    calls, out = [], io.StringIO()
    monkeypatch.setattr(runtime, "installed", lambda name: {"torch": "2.11.0+cpu"}.get(name))
    monkeypatch.setattr(runtime.sys, "platform", "linux")

    def pip(command, **kwargs):
        calls.append(command)
        return types.SimpleNamespace(returncode=0)

    runtime.install_triton(run=pip, out=out)
    assert calls == [[sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "triton==3.6.0"]]
    line = out.getvalue()
    assert line.count("\n") == 1 and line.startswith("This runtime has no Triton: installing triton==3.6.0, the release torch 2.11.0+cpu")
    assert re.search(r"done in \d+ s\.$", line.strip())


def test_triton_that_cannot_be_installed_fails_with_one_line_of_advice(monkeypatch):
    monkeypatch.setattr(runtime, "installed", lambda name: {"torch": "2.11.0+cpu"}.get(name))
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    failed = lambda command, **kwargs: types.SimpleNamespace(returncode=1)  # no network, say
    with pytest.raises(ModuleNotFoundError) as caught:
        runtime.install_triton(run=failed, out=io.StringIO())
    assert caught.value.name == "triton"
    assert str(caught.value) == runtime.triton_hint()
    assert "pip install triton==3.6.0 " in str(caught.value) and "GPU" in str(caught.value)
    assert "no build for this system" in runtime.triton_hint("darwin")
    monkeypatch.setattr(runtime, "installed", lambda name: {"torch": "2.4.0"}.get(name))  # no known pairing
    with pytest.raises(ModuleNotFoundError):
        runtime.install_triton(run=failed, out=io.StringIO())


def run_setup_cell(fake_site: pathlib.Path, extra: str) -> subprocess.CompletedProcess:
    """The setup cell in a fresh interpreter whose only packages are the fake distributions in fake_site (-S: no
    site-packages), as a runtime with those versions would run it. The check imports none of them."""
    env = dict(os.environ, PYTHONPATH=str(fake_site))
    return subprocess.run([sys.executable, "-S", "-c", SETUP + "\n" + extra], cwd=ROOT / "chapters", env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def fake_distribution(site: pathlib.Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_setup_cell_names_a_too_old_torch(tmp_path):
    for name, version in (("torch", "2.5.1"), ("triton", "3.1.0"), ("numpy", "2.0.2"), ("matplotlib", "3.10.0"),
                          ("altair", "5.5.0")):
        fake_distribution(tmp_path, name, version)
    result = run_setup_cell(tmp_path, "print('went on')")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "went on\n"
    lines = result.stderr.splitlines()
    assert lines[0].startswith("torch 2.5.1 is older than 2.9") and lines[3].startswith("triton 3.1.0 is older than")
    assert lines[2] == "Fix: pip install --upgrade 'torch>=2.9', then restart the kernel."
    assert len(lines) == 6


def test_the_setup_cell_installs_a_missing_triton_when_a_cell_imports_it(tmp_path):
    for name, version in (("torch", "2.11.0+cpu"), ("numpy", "2.1.3"), ("matplotlib", "3.10.0"), ("altair", "5.5.0")):
        fake_distribution(tmp_path, name, version)
    # pip stands in: it "installs" a package named triton where the interpreter finds it
    extra = f"""
import lib.runtime, pathlib, types
def pip(command, **kwargs):
    (pathlib.Path({str(tmp_path)!r}) / "triton").mkdir()
    (pathlib.Path({str(tmp_path)!r}) / "triton" / "__init__.py").write_text(f"installed = {{command[2:]!r}}")
    return types.SimpleNamespace(returncode=0)
lib.runtime.install_triton.__defaults__ = (pip, None)
print("before any import")
import triton
print("triton", triton.installed)
"""
    result = run_setup_cell(tmp_path, extra)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "before any import"  # the setup cell itself installs nothing
    assert lines[1].startswith("This runtime has no Triton: installing triton==3.6.0, the release torch")
    assert re.search(r"done in \d+ s\.$", lines[1])
    assert lines[2] == "triton ['pip', 'install', '--quiet', '--no-deps', 'triton==3.6.0']"
    assert len(lines) == 3


def test_lib_flash_without_triton_says_what_to_do_in_one_line():
    blocked = "import sys\nsys.modules['triton'] = None\n"  # an import of triton fails, as where it is absent
    code = blocked + "import lib.runtime\ntry:\n    import lib.flash\nexcept ModuleNotFoundError as err:\n    print(err)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("lib.flash: this cell's kernels need Triton: pip install triton")
    assert result.stdout.count("\n") == 1


def test_package_sets_reads_a_set_and_refuses_a_loose_pin(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import package_sets
    finally:
        sys.path.remove(str(ROOT / "tools"))
    cpu = package_sets.read_set(SETS["colab-cpu"])
    assert (cpu["name"], cpu["python"], cpu["without"]) == ("colab-cpu", "3.13", ["triton"])
    assert "torch==2.11.0" in cpu["pins"] and not any(pin.startswith("triton") for pin in cpu["pins"])
    loose = tmp_path / "loose.txt"
    loose.write_text("# python: 3.12\ntorch>=2.9\n")
    with pytest.raises(ValueError, match="pinned"):
        package_sets.read_set(loose)
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert package_sets.find_python(here)[1] is True
    assert package_sets.find_python("2.0") == (sys.executable, False)


def test_make_colab_writes_the_setup_cell_into_every_page(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_colab
    finally:
        sys.path.remove(str(ROOT / "tools"))
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "setup_cell.py").write_text(SETUP + "print('a new line')\n")
    for folder, name in (("chapters", "01_token_by_token.ipynb"), ("guide", "debugging.ipynb")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_bytes((ROOT / folder / name).read_bytes())
    changed = make_colab.apply_setup_cell(tmp_path)
    assert [p.name for p in changed] == ["01_token_by_token.ipynb", "debugging.ipynb"]
    for path in changed:
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        assert "".join(cells[0]["source"]).endswith("print('a new line')")
        original = [c for c in json.loads((ROOT / path.parent.name / path.name).read_text())["cells"]
                    if c["cell_type"] == "code"]
        assert cells[1:] == original[1:] and cells[0]["outputs"] == original[0]["outputs"]
    assert make_colab.apply_setup_cell(tmp_path) == []  # a second run changes nothing
    nb = json.loads(changed[0].read_text())
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    first["metadata"]["tags"] = []
    changed[0].write_text(json.dumps(nb))
    with pytest.raises(make_colab.ConversionError, match="not the hidden setup cell"):
        make_colab.apply_setup_cell(tmp_path)


def test_a_failed_install_is_not_retried_and_every_import_says_why(monkeypatch):
    attempts = []

    def cannot(*args, **kwargs):
        attempts.append(1)
        raise ModuleNotFoundError(runtime.triton_hint("darwin"), name="triton")

    monkeypatch.setattr(runtime, "install_triton", cannot)
    finder = runtime._TritonOnDemand()
    assert finder.find_spec("numpy") is None
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError, match="no build for this system"):
            finder.find_spec("triton")
    assert attempts == [1]
