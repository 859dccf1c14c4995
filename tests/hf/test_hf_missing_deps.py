"""Without transformers, importing linattn.hf says how to install the extra."""

import sys

import pytest


def test_missing_transformers_gives_the_install_hint(monkeypatch):
    for name in [m for m in sys.modules if m == "linattn.hf" or m.startswith("linattn.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r'pip install "linattn\[hf\]"') as info:
        import linattn.hf  # noqa: F401
    assert "'transformers'" in str(info.value)
