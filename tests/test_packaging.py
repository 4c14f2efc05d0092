"""What a non-editable `pip install .` (the README's first command) puts in site-packages: every
package of the source tree, named in pyproject.toml's explicit list, and the embedded model's files."""
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _listed_packages() -> set[str]:
    block = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    assert block, "pyproject.toml's [tool.setuptools] packages list"
    return set(re.findall(r'"([\w.]+)"', block.group(1)))


def _source_packages() -> set[str]:
    found = set()
    for top, name in (("flexsgl", "flexsgl"), ("overrides", "flexsgl.overrides")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((name, *rel)))
    return found


def test_every_source_package_is_installed():
    listed, source = _listed_packages(), _source_packages()
    assert source - listed == set(), f"packages a non-editable install would leave out: {sorted(source - listed)}"
    assert listed - source == set(), f"packages pyproject.toml names that do not exist: {sorted(listed - source)}"


def test_the_embedded_model_is_package_data():
    data = re.search(r'^flexsgl = \["([^"]+)"\]', (ROOT / "pyproject.toml").read_text(), re.M)
    assert data, "pyproject.toml's package-data for flexsgl"
    files = list((ROOT / "flexsgl").glob(data.group(1)))
    assert any(f.name == "config.json" for f in files) and any(f.suffix == ".safetensors" for f in files), files
