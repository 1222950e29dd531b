"""The plugin manager: entry-point loading, the allow-list, validation, conflicts, hook order."""

from __future__ import annotations

import importlib.metadata
import json
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest

import turbospark_core
from turbospark_core import hookimpl, plugins
from turbospark_core.errors import OptionError, PluginError, UnknownFamilyError
from turbospark_core.registry import FamilySpec

DUMMY_DIST = "turbospark-dummy"
DUMMY_INSTALL = "pip install -e tests/plugins/turbospark_dummy"


@pytest.fixture
def fresh_plugins() -> Iterator[pluggy.PluginManager]:
    """Start with nothing loaded; leave nothing loaded (the next load_plugins() reloads)."""
    plugins.reset_plugins()
    try:
        yield plugins.pm
    finally:
        plugins.reset_plugins()


@pytest.fixture
def register(fresh_plugins: pluggy.PluginManager) -> Iterator[Callable[[object, str], None]]:
    """``register(plugin, name)`` on the global manager, unregistered by name afterwards."""
    names: list[str] = []

    def _register(plugin: object, name: str) -> None:
        fresh_plugins.register(plugin, name=name)
        names.append(name)

    try:
        yield _register
    finally:
        for name in names:
            if fresh_plugins.get_plugin(name) is not None:
                fresh_plugins.unregister(name=name)


def _loaded() -> set[str]:
    return {name for name, _ in plugins.pm.list_name_plugin()}


# ------------------------------------------------------------------ entry points


def test_entry_point_loading_finds_the_dummy_distribution(
    fresh_plugins: pluggy.PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        dist = importlib.metadata.distribution(DUMMY_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"the test plugin distribution {DUMMY_DIST!r} is not installed; run `{DUMMY_INSTALL}`")
    assert [ep.name for ep in dist.entry_points if ep.group == "turbospark"] == ["dummy"]
    monkeypatch.delenv(plugins.ALLOW_LIST_ENV, raising=False)

    plugins.load_plugins()

    assert fresh_plugins.get_plugin("dummy").__name__ == "turbospark_dummy.plugin"
    dummy = {f.name: f for f in plugins.registry().families()}["dummy"]
    assert dummy.model_types == ("dummy_lm",) and dummy.distribution == DUMMY_DIST
    hooks = plugins.family_hooks("dummy_lm")
    assert hooks.spec == dummy
    assert hooks.arch_problems({"model_type": "dummy_lm"}) == []
    assert plugins.arch_from_hf_config({"model_type": "dummy_lm", "hidden_size": 8, "vocab_size": 16}) == {
        "model_type": "dummy_lm",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "vocab_size": 16,
    }


@pytest.mark.parametrize(
    ("allow", "expected"), [("llama", {"llama"}), (" llama , not_installed ", {"llama"}), ("", set())]
)
def test_allow_list_restricts_which_entry_points_load(
    fresh_plugins: pluggy.PluginManager, monkeypatch: pytest.MonkeyPatch, allow: str, expected: set[str]
) -> None:
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, allow)
    plugins.load_plugins()
    assert _loaded() == expected  # the dummy (when installed) is left out in every case
    assert {f.name for f in plugins.registry().families()} == expected


def test_empty_allow_list_leaves_a_clear_refusal(
    fresh_plugins: pluggy.PluginManager, monkeypatch: pytest.MonkeyPatch, f32_install: Path
) -> None:
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "")
    with pytest.raises(UnknownFamilyError) as err:
        turbospark_core.open(f32_install)
    assert str(err.value) == (
        "no installed plugin serves model type 'llama'; installed families: none; install turbospark-llama"
    )


def test_load_plugins_is_idempotent(fresh_plugins: pluggy.PluginManager, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins.load_plugins()
    first = fresh_plugins.list_name_plugin()
    assert "llama" in dict(first)
    calls: list[int] = []
    real = plugins._entry_points
    monkeypatch.setattr(plugins, "_entry_points", lambda: calls.append(1) or real())
    plugins.load_plugins()
    plugins.registry()
    assert calls == [] and fresh_plugins.list_name_plugin() == first
    plugins.reset_plugins()  # and a reset makes the next call load again
    plugins.load_plugins()
    assert calls == [1] and _loaded() == {name for name, _ in first}


def test_concurrent_first_loads_register_each_plugin_once(fresh_plugins: pluggy.PluginManager) -> None:
    errors: list[BaseException] = []

    def load() -> None:
        try:
            plugins.load_plugins()
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and "llama" in _loaded()


class _FakeEntryPoint:
    """An entry point of a distribution that is installed but broken."""

    def __init__(self, name: str, value: str, dist: str) -> None:
        self.name, self.value, self.group = name, value, "turbospark"
        self.dist = types.SimpleNamespace(name=dist)
        self._real = importlib.metadata.EntryPoint(name=name, value=value, group="turbospark")

    def load(self) -> Any:
        return self._real.load()


def test_entry_point_import_failure_names_entry_point_and_distribution(
    fresh_plugins: pluggy.PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = _FakeEntryPoint("broken", "turbospark_no_such_module.plugin", "turbospark-broken")
    monkeypatch.setattr(plugins, "_entry_points", lambda: [broken])
    monkeypatch.delenv(plugins.ALLOW_LIST_ENV, raising=False)
    with pytest.raises(PluginError) as err:
        plugins.load_plugins()
    msg = str(err.value)
    for part in ("'broken'", "turbospark_no_such_module.plugin", "'turbospark-broken'", "ModuleNotFoundError"):
        assert part in msg, msg
    assert plugins.ALLOW_LIST_ENV in msg
    assert isinstance(err.value.__cause__, ModuleNotFoundError)
    # the advice works: leaving it out of the allow-list loads the rest
    monkeypatch.setenv(plugins.ALLOW_LIST_ENV, "llama")
    plugins.load_plugins()
    assert "broken" not in _loaded()


# ------------------------------------------------------------------ validation and conflicts


class _Misspelled:
    @hookimpl
    def build_family_stat(self, context: Any) -> None:  # sic: build_family_state
        return None


def test_misspelled_hookimpl_is_refused_by_check_pending(register: Callable[[object, str], None]) -> None:
    register(_Misspelled(), "misspelled")
    with pytest.raises(PluginError) as err:
        plugins.load_plugins()
    msg = str(err.value)
    assert "build_family_stat" in msg and "_Misspelled" in msg and "does not exist" in msg
    assert isinstance(err.value.__cause__, pluggy.PluginValidationError)


class _Rival:
    @hookimpl
    def register_families(self, register: Callable[[FamilySpec], None]) -> None:
        register(FamilySpec(name="rival", model_types=("rival_lm", "llama"), distribution="turbospark-rival"))


def test_two_plugins_claiming_one_model_type_names_both(register: Callable[[object, str], None]) -> None:
    plugins.load_plugins()
    register(_Rival(), "rival")
    with pytest.raises(PluginError) as err:
        plugins.registry()
    msg = str(err.value)
    for part in ("model type 'llama'", "'llama' (family 'llama')", "'rival' (family 'rival')"):
        assert part in msg, msg
    assert "turbospark-llama" in msg and "turbospark-rival" in msg


class _GGUFRival:
    @hookimpl
    def register_families(self, register: Callable[[FamilySpec], None]) -> None:
        register(FamilySpec(name="rival", model_types=("rival_lm",), distribution="d", gguf_architectures=("llama",)))


def test_two_plugins_claiming_one_gguf_architecture_names_both(register: Callable[[object, str], None]) -> None:
    plugins.load_plugins()
    register(_GGUFRival(), "rival")
    with pytest.raises(PluginError) as err:
        plugins.registry()
    msg = str(err.value)
    for part in ("GGUF architecture 'llama'", "'llama' (family 'llama')", "'rival' (family 'rival')"):
        assert part in msg, msg


def test_unknown_model_type_refusal_lists_installed_families(fresh_plugins: pluggy.PluginManager) -> None:
    with pytest.raises(UnknownFamilyError) as err:
        plugins.family_hooks("made_up_lm", distribution="turbospark-madeup")
    msg = str(err.value)
    assert msg.startswith("no installed plugin serves model type 'made_up_lm'; installed families: ")
    assert "llama (llama, qwen2, qwen3, qwen3_moe, minimax_m2, qwen3_vl)" in msg
    for family in plugins.registry().families():
        assert f"{family.name} ({', '.join(family.model_types)})" in msg
    assert msg.endswith("; install turbospark-madeup")
    assert isinstance(err.value, LookupError)
    with pytest.raises(UnknownFamilyError) as generic:
        plugins.family_hooks("made_up_lm")
    assert str(generic.value).endswith("install the turbospark plugin distribution that serves it")


# ------------------------------------------------------------------ hook order at open


def _record(pm: pluggy.PluginManager) -> tuple[list[tuple[str, list[str]]], Callable[[], None]]:
    calls: list[tuple[str, list[str]]] = []

    def before(hook_name: str, hook_impls: list[Any], kwargs: dict[str, Any]) -> None:
        calls.append((hook_name, [impl.plugin_name for impl in hook_impls]))

    def after(outcome: Any, hook_name: str, hook_impls: list[Any], kwargs: dict[str, Any]) -> None:
        pass

    return calls, pm.add_hookcall_monitoring(before, after)


def _open_recording(path: Path, **options: Any) -> list[tuple[str, list[str]]]:
    """The hooks fired by one open, after the registry's ``register_families`` calls."""
    plugins.load_plugins()
    calls, undo = _record(plugins.pm)
    try:
        turbospark_core.open(path, **options)
    finally:
        undo()
    return _after_registry(calls)


def _after_registry(calls: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Check the registry was built once, one plugin per ``register_families`` call; the calls after."""
    registering = [impls for name, impls in calls if name == "register_families"]
    implementers = [impl.plugin_name for impl in plugins.pm.hook.register_families.get_hookimpls()]
    assert registering == [[name] for name in implementers]
    assert [name for name, _ in calls[: len(registering)]] == ["register_families"] * len(registering)
    return calls[len(registering) :]


OPEN_HOOKS = ["arch_problems", "accepts_hadamard", "steering_supported", "cache_layout", "build_family_state"]


def test_open_fires_hooks_in_order_on_the_serving_plugin_only(install: Path, tamper: Any) -> None:
    config = json.loads((install / "tokenizer_config.json").read_text())
    del config["chat_template"]  # so the family's default template is asked for
    tamper.put_file(install, "tokenizer_config.json", json.dumps(config).encode())
    calls = _open_recording(install)
    # the tokenizer (and so its template) is read before the weights, ahead of the family's state
    assert [name for name, _ in calls] == [*OPEN_HOOKS[:-1], "default_chat_template", OPEN_HOOKS[-1]]
    # only the serving plugin is asked (llama has no default template: no impl at all)
    assert [impls for _, impls in calls] == [["llama"]] * (len(OPEN_HOOKS) - 1) + [[], ["llama"]]


def test_open_of_an_install_with_a_template_fires_only_the_open_hooks(f32_install: Path) -> None:
    calls = _open_recording(f32_install)
    assert [name for name, _ in calls] == OPEN_HOOKS


def test_kv_quant_probe_fires_before_any_weight_is_read(f32_install: Path) -> None:
    plugins.load_plugins()
    calls, undo = _record(plugins.pm)
    try:
        # the fixture's head_dim 16 has no quantization group: refused before any weight is read
        with pytest.raises(OptionError, match=r"kv_quant='q8'.*head_dim 16"):
            turbospark_core.open(f32_install, kv_quant="q8")
    finally:
        undo()
    names = [name for name, _ in _after_registry(calls)]
    assert names == [
        "arch_problems",
        "kv_quant_unsupported_reason",
        "accepts_hadamard",
        "steering_supported",
        "cache_layout",
    ]


def test_monitoring_sees_register_families_and_routed_conversion_hooks(llama_src: Path) -> None:
    hf_config = json.loads((llama_src / "config.json").read_text())
    plugins.load_plugins()
    calls, undo = _record(plugins.pm)
    try:
        arch = plugins.arch_from_hf_config(hf_config)
    finally:
        undo()
    assert arch is not None and arch["model_type"] == "llama"
    assert _after_registry(calls) == [("arch_from_hf_config", ["llama"])]  # asked of the owner only


def test_conversion_hooks_go_to_the_plugin_that_claims_the_model_type_or_architecture(
    register: Callable[[object, str], None],
) -> None:
    asked: list[str] = []

    class Other:
        @hookimpl
        def register_families(self, register: Callable[[FamilySpec], None]) -> None:
            register(FamilySpec(name="other", model_types=("other_lm",), distribution="d", gguf_architectures=("oth",)))

        @hookimpl
        def arch_from_hf_config(self, hf_config: dict[str, Any]) -> dict[str, Any]:
            asked.append("hf")
            return {"model_type": "other_lm"}  # answers for anything: only routing keeps it off llama's types

        @hookimpl
        def arch_from_gguf(
            self, architecture: str, metadata: dict[str, Any], tensor_names: list[str]
        ) -> dict[str, Any]:
            asked.append("gguf")
            return {"model_type": "other_lm"}

    plugins.load_plugins()
    register(Other(), "other")
    assert plugins.arch_from_hf_config({"model_type": "other_lm"}) == {"model_type": "other_lm"}
    assert plugins.arch_from_gguf("oth", {}, []) == {"model_type": "other_lm"}
    assert asked == ["hf", "gguf"]
    assert plugins.arch_from_hf_config({"model_type": "made_up_lm"}) is None  # nobody claims it: nobody asked
    assert plugins.arch_from_gguf("made_up", {}, []) is None
    assert asked == ["hf", "gguf"]
