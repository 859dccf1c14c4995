import sys
import types

import pytest

from linattn.bench.kernel_variants import compiled_variants


class FakeJit:
    """Holds per-device caches laid out as Triton's JIT functions hold them: (kernel cache, ...) per device."""

    def __init__(self, *variants_per_device: int) -> None:
        self.device_caches = {d: ({k: object() for k in range(n)}, {}, None, None, None)
                              for d, n in enumerate(variants_per_device)}


class Wrapper:
    """Forwards attribute reads to its kernel, as the launch wrapper (triton_launch.FastKernel) does."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernel, name)


class Autotuned:
    def __init__(self, fn: object) -> None:
        self.fn = fn


@pytest.fixture
def fake_modules(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    mods = {name: types.ModuleType(name) for name in ("fakepkg", "fakepkg.a", "fakepkg.b", "fakepkgother")}
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods


def test_counts_every_device_and_wrapped_kernel_once(fake_modules: dict[str, types.ModuleType]) -> None:
    shared = FakeJit(2)
    fake_modules["fakepkg.a"].k1 = FakeJit(1, 3)  # two devices
    fake_modules["fakepkg.a"].k2 = Wrapper(Autotuned(shared))
    fake_modules["fakepkg.b"].k2 = shared  # imported into a second module: counted once
    fake_modules["fakepkg.b"].unrelated = 7
    fake_modules["fakepkgother"].k = FakeJit(5)  # another package whose name merely starts alike
    assert compiled_variants("fakepkg") == 1 + 3 + 2


def test_new_variants_show_in_the_difference(fake_modules: dict[str, types.ModuleType]) -> None:
    kernel = FakeJit(1)
    fake_modules["fakepkg"].kernel = kernel
    before = compiled_variants("fakepkg")
    kernel.device_caches[0][0]["a new specialisation"] = object()
    assert compiled_variants("fakepkg") - before == 1


def test_none_without_caches(fake_modules: dict[str, types.ModuleType]) -> None:
    fake_modules["fakepkg.a"].f = lambda: None
    assert compiled_variants("fakepkg") is None
